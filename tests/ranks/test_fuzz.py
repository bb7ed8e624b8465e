"""Property-based tests (hypothesis): random MLP / transformer jobs x meshes x modes x memory options
train like one device, or are refused by autopar's own error on every rank (``fuzz_check.py``).

The fast profile here runs a few fixed cases that reach each path (tensor parallelism, a 2-D plan
with ZeRO and accumulation, a tagged pipeline, bf16, HYBRID under a memory cap, a refusal) and a
few drawn ones, derandomized so CI draws the same cases. ``bench/fuzz.py`` runs hundreds
(bench/RESULTS.md). The checker itself is tested too: it must fail a run that differs from one
device, a raw torch error, and shrink a failure to a small case.
"""
from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

import autopar
from conftest import run_ranks
from fuzz_cases import Annotation, Case, cases
from fuzz_check import _refusal, check_case, error_record, judge
from fuzz_models import MLPSpec, TransformerSpec, batch_of, build, loss_of
from fuzz_shrink import shrink, simpler
from oracle import reference_run

GPT = TransformerSpec(vocab=32, seq=4, hidden=8, heads=2, ffn=16, layers=2, tied=True, fused_qkv=False, bias=True,
                      norm="layer", act="gelu")
MLP = MLPSpec(d_in=8, widths=(16, 16), acts=("gelu", "tanh"), bias=(True, False), classes=5)
MEGATRON = (Annotation("layers.0.fc", "tp", 0, True), Annotation("layers.1.fc", "tp", 1))
MEGATRON_D1 = (Annotation("layers.0.fc", "d1", 0, True), Annotation("layers.1.fc", "d1", 1))

CASES = {
    "tensor parallel": Case(GPT, 4, (2,), ("tp",), "semi_auto", optim="adamw",
                            shards=(Annotation("blocks.*.fc1", "tp", 0, True), Annotation("blocks.*.fc2", "tp", 1))),
    "dp x tp, ZeRO-2, accumulation": Case(MLP, 8, (2, 2), ("dp", "tp"), "semi_auto", zero=2, accumulation=2,
                                          clip=0.5, shards=MEGATRON),
    "tagged pipeline, recompute": Case(GPT, 8, (2,), ("pp",), "semi_auto", micro=2, recompute="full",
                                       stages=(("blocks.1", 1),)),
    "bf16 data parallel": Case(MLP, 8, (2,), None, "data", optim="adamw", mixed_precision="bf16"),
    "hybrid under a memory cap": Case(MLP, 8, (2,), None, "hybrid", source="auto", memory_fraction=0.6),
    "auto on an unnamed mesh, annotated": Case(MLP, 8, (2, 2), None, "auto", shards=MEGATRON_D1),
    "refused: ZeRO with a pipeline": Case(MLP, 4, (2,), ("pp",), "auto", zero=2),
    "ill-conditioned row-parallel (fp32 noise bar)": Case(    # 1.9e-5 from one device, as plain torch split so
        TransformerSpec(vocab=16, seq=2, hidden=8, heads=2, ffn=8, layers=2, tied=True, fused_qkv=False, bias=True,
                        norm="layer", act="gelu"), 16, (2,), ("tp",), "semi_auto", micro=2, steps=1,
        shards=(Annotation("blocks.*.fc2", "tp", 1),)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_fixed_case_takes_its_path(name):
    """Each fixed case trains like one device (or is refused) and reaches the path it is named for."""
    case = CASES[name]
    outcome = check_case(case, run_ranks)
    if name.startswith("refused"):
        assert outcome.status == "refused" and "not supported with a pipeline" in outcome.detail, outcome
        return
    assert outcome.status == "trained", outcome.detail
    if "noise bar" in name:     # 1.9e-5 from one device on the VM the case was found on; within
        # 1e-5 on an AMD EPYC VM (2026-11-28): the split's rounding depends on the CPU's kernels, so either
        # bar is this case's path (the noise bar's failing side: test_the_property_fails_a_run_that_differs...)
        assert outcome.bar.startswith("fp32 noise") or outcome.bar == "1e-5", outcome.bar
        return
    plan = outcome.plan
    expect = {"tensor parallel": "none; 6/34 params split", "dp x tp, ZeRO-2, accumulation": "ZeRO-2, accumulation 2",
              "tagged pipeline, recompute": "pp=2", "bf16 data parallel": "bf16", "hybrid under a memory cap": "",
              "auto on an unnamed mesh, annotated": ""}
    assert expect[name] in plan, plan
    unsplit = ("bf16 data parallel", "tagged pipeline, recompute")     # whole weights on every rank or stage
    assert not plan.split("; ")[2].startswith("0/") or name in unsplit, plan


def _random_job(case):
    outcome = check_case(case, run_ranks)
    assert outcome.status != "failed", f"{outcome.detail}\nreplay: check_case({case!r}, run_ranks)"


_SETTINGS = dict(derandomize=True, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=5, **_SETTINGS)
@given(cases())
def test_random_jobs_train_like_one_device_or_are_refused_clearly(case):
    _random_job(case)


@pytest.mark.slow  # bench/fuzz.py runs hundreds
@settings(max_examples=25, **_SETTINGS)
@given(cases())
def test_more_random_jobs_train_like_one_device_or_are_refused_clearly(case):
    _random_job(case)


def _stand_alone_run(case: Case) -> dict:
    """The single-device run as if a rank had returned it (with a stand-alone plan)."""
    x, y = batch_of(case.model, case.batch)
    ref = reference_run(functools.partial(build, case.model), loss_of(case.model), x, y, steps=case.steps,
                        mixed_precision=case.mixed_precision)
    plan = autopar.plan(build(case.model), autopar.Mesh(1), example_inputs=(x,), loss_fn=loss_of(case.model),
                        example_target=y, mode="stand_alone", mixed_precision=case.mixed_precision)
    return dict(copy.deepcopy(ref), plan=plan.to_json(), optim="sgd")


def test_the_property_fails_a_run_that_differs_from_one_device():
    case = Case(MLP, 4, (1,), None, "stand_alone")
    run = _stand_alone_run(case)
    assert judge(case, [run], run_ranks) == ("", "1e-5")
    run["grads"][0]["head.weight"] *= 1 + 1e-4      # past 1e-5, and past fp32's own distance from float64
    msg, bar = judge(case, [run], run_ranks)
    assert msg.startswith("against the float64 run: rank 0 grads at step 1, worst tensor: 1.0"), msg
    assert "1e-5 bar: rank 0 grad before step 1 head.weight: relative error 1.0" in msg, msg
    assert bar.startswith("fp32 noise (one device, DDP on 2 ranks"), bar


def test_the_bf16_property_fails_a_gradient_off_by_5_percent():
    case = Case(MLP, 4, (1,), None, "stand_alone", mixed_precision="bf16")
    run = _stand_alone_run(case)
    assert judge(case, [run], run_ranks)[0] == ""
    for g in run["grads"][0].values():
        g *= 1.05
    msg, bar = judge(case, [run], run_ranks)
    assert "from the single-device bf16 run" in msg and "from the float64 run" in msg, msg


def test_only_an_autopar_error_on_every_rank_is_a_refusal():
    try:
        torch.zeros(2, 3) @ torch.zeros(2, 3)
    except RuntimeError as err:
        raw = error_record(err)
    autopar.set_auto_parallel_context(zero=2)
    try:
        autopar.plan(build(MLP), autopar.Mesh(1), example_inputs=batch_of(MLP, 4)[:1], loss_fn=loss_of(MLP),
                     example_target=batch_of(MLP, 4)[1], mode="semi_auto")
    except autopar.PlanError as err:
        ours = error_record(err)
    from autopar.solver.intra_op import IntraOpProblem, NodeChoices
    from autopar.solver.greedy import greedy_choice

    try:                            # a builtin's error inside autopar's code is not a clear refusal
        greedy_choice(IntraOpProblem([NodeChoices("n", np.zeros(1), np.zeros(1), [])], []))
    except ValueError as err:
        builtin = error_record(err)
    assert builtin["message"] == "min() arg is an empty sequence" and not builtin["autopar"]
    assert not raw["autopar"] and ours["autopar"]
    assert _refusal([ours, ours], 2).startswith("PlanError: zero=2 shards")
    assert _refusal([ours, raw], 2) is None
    assert _refusal([ours], 2) is None, "one rank refusing while another trains is a failure"


def test_shrink_keeps_what_the_failure_needs_and_drops_the_rest():
    big = Case(GPT, 8, (2, 2), ("dp", "tp"), "hybrid", source="semi_auto", optim="adamw", micro=2, clip=0.5, zero=1,
               recompute="full", mixed_precision="bf16", shards=(Annotation("blocks.*.fc1", "tp", 0),))
    seen = []

    def fails(c: Case) -> bool:
        seen.append(c)
        names = c.axis_names or ()
        return c.model.layers == 2 and "tp" in names and c.shape[names.index("tp")] == 2 and bool(c.shards)

    small, runs = shrink(big, fails, budget=200)
    assert runs == len(seen) < 200
    assert (small.model.layers, small.shape, small.axis_names, small.shards) == (2, (2,), ("tp",), big.shards)
    assert (small.mode, small.zero, small.recompute, small.mixed_precision, small.micro, small.clip) == (
        "semi_auto", None, None, None, 1, None)
    assert small.model.heads == 1 and small.batch == 1
    assert not any(fails(c) for c in simpler(small))
