"""Gradient accumulation as a plan choice, in one process: AUTO picks the smallest k that fits the memory cap, a
user can fix k (``set_auto_parallel_context(accumulation=k)``), and what cannot be accumulated is refused clearly.
Training on ranks: tests/ranks/test_accumulation_plan.py."""
from __future__ import annotations

import pytest

import autopar
from examples.models import lm_loss
from oracle import assert_same_training, make_batch, parallel_run, reference_run
from accumulation_jobs import BATCH, MODEL, _capped_mesh


def test_auto_picks_the_smallest_accumulation_that_fits():
    """With recomputation and ZeRO ruled out, accumulation is the only lever (ZeRO-1 with accumulation is
    what AUTO takes with ZeRO free: a search of four ZeRO stages, 2.3x as long)."""
    x, y = make_batch("tokens", BATCH)
    mesh = _capped_mesh()
    autopar.set_auto_parallel_context(recompute="none", zero=0)
    plan = autopar.plan(MODEL(), mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, mode="auto")
    k = plan.memory_options.accumulation
    assert k > 1 and plan.accumulation_trace.size == BATCH // k
    assert max(plan.memory_per_device) <= mesh.memory_gb * 2**30
    assert f"accumulation {k}" in plan.report()
    free = autopar.plan(MODEL(), autopar.Mesh(2, axis_names=("dp",)), example_inputs=(x,), loss_fn=lm_loss,
                        example_target=y, mode="auto")
    assert free.memory_options.accumulation == 1, "without a cap nothing needs accumulation"
    assert plan.step_time > free.step_time, "k microbatches cost more than one batch"
    half = autopar.Plan.from_json(plan.to_json())
    assert half == plan and half.accumulation_trace == plan.accumulation_trace


def test_accumulation_that_does_not_divide_the_batch_is_refused():
    x, y = make_batch("tokens", 8)
    autopar.set_auto_parallel_context(accumulation=3)
    with pytest.raises(autopar.PlanError, match="accumulation=3 does not divide the global batch 8; use a divisor of 8"):
        autopar.plan(MODEL(), autopar.Mesh(2), example_inputs=(x,), loss_fn=lm_loss, example_target=y, mode="data")


@pytest.mark.parametrize("mode", ["data", "auto"])
def test_accumulation_that_leaves_microbatches_dp_cannot_split_says_so(mode):
    """Found by tests/ranks/test_fuzz.py: was "no plan fits memory", though no memory cap was involved."""
    x, y = make_batch("tokens", 8)
    autopar.set_auto_parallel_context(accumulation=8)
    want = (r"^no plan can be made on Mesh\(dp=2.*: accumulation 8: the global batch \(1, .* not divisible by the "
            r"data-parallel size 2.*\(accumulation 8 runs the global batch of 8 as 8 microbatches of 1; a smaller")
    with pytest.raises(autopar.PlanError, match=want):
        autopar.plan(MODEL(), autopar.Mesh(2, axis_names=("dp",)), example_inputs=(x,), loss_fn=lm_loss,
                     example_target=y, mode=mode)


def test_an_annotation_that_cannot_be_applied_under_accumulation_is_not_called_memory():
    """Found by tests/ranks/test_fuzz.py: a fixed accumulation's microbatch failing for any reason but memory was
    reported as "no plan fits memory"."""
    x, y = make_batch("tokens", 8)
    autopar.set_auto_parallel_context(accumulation=2)
    autopar.shard("wte", weight={"tp": autopar.Shard(0)})
    want = r"^no plan can be made on Mesh\(tp=3.*: accumulation 2: wte.weight: dimension 0 of size 128 is not divisible"
    with pytest.raises(autopar.PlanError, match=want):
        autopar.plan(MODEL(), autopar.Mesh(3, axis_names=("tp",)), example_inputs=(x,), loss_fn=lm_loss,
                     example_target=y, mode="semi_auto")


@pytest.mark.parametrize("mode,names", [("data", None), ("auto", ("dp",))])
def test_microbatches_of_one_row_on_one_device_train_like_one_device(mode, names):
    """Found by tests/ranks/test_fuzz.py: DATA (and a named dp axis) forced Shard(0) on inputs of one row, which no
    candidate offers (a dim of size 1 is never split): 'min() arg is an empty sequence' while planning."""
    x, y = make_batch("tokens", 4)
    autopar.set_auto_parallel_context(accumulation=4)
    ref = reference_run(MODEL, lm_loss, x, y)
    r = parallel_run(0, MODEL, lm_loss, x, y, autopar.Mesh(1, axis_names=names), mode)
    assert autopar.Plan.from_json(r["plan"]).accumulation_trace.size == 1
    assert_same_training(ref, r, 1e-5, f"{mode} accumulation 4 of 4 rows")


def test_accumulation_with_a_pipeline_is_refused():
    x, y = make_batch("tokens", 8)
    autopar.set_auto_parallel_context(accumulation=2)
    with pytest.raises(autopar.PlanError, match="set microbatches= instead of accumulation"):
        autopar.plan(MODEL(), autopar.Mesh(2, axis_names=("pp",)), example_inputs=(x,), loss_fn=lm_loss,
                     example_target=y, mode="auto")


def test_bad_accumulation_setting_is_refused():
    with pytest.raises(ValueError, match="accumulation must be None or a positive int, got 0"):
        autopar.set_auto_parallel_context(accumulation=0)


def test_a_step_on_another_batch_shape_is_refused():
    x, y = make_batch("tokens", 8)
    autopar.set_auto_parallel_context(accumulation=2)
    pmodel = autopar.parallelize(MODEL(), autopar.Mesh(1), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                                 mode="stand_alone")
    with pytest.raises(ValueError, match=r"planned for the global shape \[8, 16\] \(run as 2 accumulated microbatches\)"):
        pmodel.step(x[:4], target=y[:4])
    out = pmodel(x)
    assert out.shape[0] == 8
