"""ZeRO as a plan choice, planned in one process: the intra-op problem costs each stage, AUTO/SEMI_AUTO try stages
0-3 while nothing fits and keep the fastest, the user can fix a stage (``set_auto_parallel_context(zero=...)``),
and the report explains each stage. Training on ranks: tests/ranks/test_zero_search.py."""
from __future__ import annotations

import re

import pytest

import autopar
from autopar.plan.plan import PlanError
from examples.models import lm_loss
from oracle import make_batch
from zero_search_jobs import BATCH, MODEL, _capped_mesh, _probe


def _plan(mesh, mode="auto"):
    x, y = make_batch("tokens", BATCH)
    return autopar.plan(MODEL(), mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, mode=mode)


def test_each_stage_divides_its_part_of_the_state():
    """AdamW in fp32: 4 B weights + 4 B gradients + 8 B moments per parameter, split over dp = 2."""
    plain = _probe()
    n = plain.memory_breakdown["params+grads+optimizer"] / 16
    for stage, per_param in ((1, 4 + 4 + 4), (2, 4 + 2 + 4), (3, 2 + 2 + 4)):
        autopar.set_auto_parallel_context(zero=stage)
        plan = _plan(autopar.Mesh(2), "data")
        assert plan.memory_options.zero == stage
        assert plan.memory_breakdown["params+grads+optimizer"] == pytest.approx(n * per_param)
        assert ("ZeRO-3 gathered layers" in plan.memory_breakdown) == (stage == 3)
        assert plan.optimizer_time < plain.optimizer_time
        assert f"ZeRO-{stage}" in plan.report()


def test_auto_shards_the_state_when_it_does_not_fit():
    mesh = _capped_mesh(0.78)
    plan = _plan(mesh)
    assert plan.memory_options.zero >= 1, plan.memory_options
    assert plan.memory_options.recompute == "none" and plan.memory_options.accumulation == 1
    assert max(plan.memory_per_device) <= mesh.memory_gb * 2**30
    free = _plan(autopar.Mesh(2, axis_names=("dp",)))
    assert free.memory_options.zero == 0, "without a cap nothing needs ZeRO"
    stage0 = [a for a in plan.alternatives if "ZeRO" not in a.memory_options and "ZeRO" not in a.note]
    assert stage0, "stage 0 was tried first"
    assert all(a.step_time >= plan.step_time for a in stage0 if a.fits), "a ZeRO stage won on predicted time"
    assert "ZeRO-" in plan.report().split("why this plan")[1]
    assert autopar.Plan.from_json(plan.to_json()) == plan


def test_bad_zero_settings_are_refused():
    with pytest.raises(ValueError, match=r"zero must be None .* or a ZeRO stage 0, 1, 2 or 3, got 4"):
        autopar.set_auto_parallel_context(zero=4)
    autopar.set_auto_parallel_context(zero=2, schedule="1f1b", microbatches=2)
    with pytest.raises(PlanError, match=r"zero=2 is not supported with a pipeline .* use zero=1 .* or zero=0"):
        _plan(autopar.Mesh(2, axis_names=("pp",)))
    autopar.reset_auto_parallel_context()
    for mode in ("semi_auto", "stand_alone"):      # found by tests/ranks/test_fuzz.py: was "no pipeline plan fits: "
        autopar.set_auto_parallel_context(zero=2)
        with pytest.raises(PlanError, match=r"zero=2 shards .* mesh .* has 1 device: there is nothing to shard it "
                                            r"over; use zero=0 \(or leave zero unset\)"):
            _plan(autopar.Mesh(1), mode)


def test_nothing_fits_names_the_smallest_candidate_and_a_device_count_that_fits():
    x, y = make_batch("tokens", BATCH)
    cap = 0.00022                   # GiB: below any 2-device plan
    with pytest.raises(PlanError) as info:
        _plan(autopar.Mesh(2, axis_names=("dp",), memory_gb=cap))
    msg = str(info.value)
    for part in ("the smallest candidate (mesh (2,)", "parameters", "gradients", "optimizer state",
                 "activations", "but the cap is 231 KiB", "devices would fit (estimate"):
        assert part in msg, msg
    devices = int(re.search(r"About (\d+) devices would fit", msg).group(1))
    assert devices > 2
    plan = _plan(autopar.Mesh(devices, axis_names=("dp",), memory_gb=cap))      # the estimate is enough
    assert max(plan.memory_per_device) <= cap * 2**30
    with pytest.raises(PlanError, match=r"One row of the batch per device already needs .* of activations"):
        _plan(autopar.Mesh(2, axis_names=("dp",), memory_gb=cap / 64))


def test_explain_says_what_each_stage_saves_and_costs():
    plan = _plan(autopar.Mesh(2), "data")
    text = plan.explain("blocks.0.fc1.weight")          # 128 x 32 fp32 elements, AdamW: 32 KiB of moments
    assert "memory options: none" in text
    assert "ZeRO-1: -16 KiB optimizer state, +" in text
    assert "ZeRO-2: -8 KiB gradients, -16 KiB optimizer state, +" in text
    assert "ZeRO-3: -8 KiB parameters, -8 KiB gradients, -16 KiB optimizer state, +" in text
    assert "ms per step" in text
    assert "ZeRO over the axes each parameter is replicated on would save" in plan.report()
