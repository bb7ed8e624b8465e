"""Only rank 0 traces before planning, or before applying a given plan: the other ranks build their modules
from rank 0's packed graph (``frontend/shared_trace.py``) and train like one device; a graph with an op only
the tracing process can run (an opaque autograd Function) is traced by every rank, as before."""
from __future__ import annotations

import functools

import pytest
import torch

import autopar.api
from autopar.plan.plan import PlanError
from conftest import run_ranks
from examples.models import GPT, lm_loss
from oracle import assert_same_training, make_batch, parallel_run, reference_run
from semantics_models import StraightThroughRound

MODEL = functools.partial(GPT, qkv_bias=False, layers=2, hidden=32)


class _Rounded(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.out(StraightThroughRound.apply(self.lin(x)))


def _mse(out, target):
    return (out - target).pow(2).mean()


def _counting(rank, model_fn, loss_fn, x, y, mode, plan_json=None):
    calls = []
    real = autopar.api.trace

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    autopar.api.trace = counted
    try:
        given = {"plan": autopar.Plan.from_json(plan_json)} if plan_json else {}
        out = parallel_run(rank, model_fn, loss_fn, x, y, autopar.Mesh(2), mode, steps=2, **given)
    finally:
        autopar.api.trace = real
    return out, len(calls)


def test_only_rank_0_traces_and_every_rank_trains_like_one_device():
    x, y = make_batch("tokens", 8)
    ref = reference_run(MODEL, lm_loss, x, y, steps=2)
    results = run_ranks(2, _counting, MODEL, lm_loss, x, y, "auto")
    assert [n for _, n in results] == [1, 0], "rank 1 should build from rank 0's graph, not trace"
    for r, _ in results:
        assert_same_training(ref, r, what="auto, rank 0's graph on rank 1")


def test_a_graph_only_its_process_can_run_is_traced_by_every_rank():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    ref = reference_run(_Rounded, _mse, x, y, steps=2)
    results = run_ranks(2, _counting, _Rounded, _mse, x, y, "data")
    assert [n for _, n in results] == [1, 1]
    for r, _ in results:
        assert_same_training(ref, r, what="opaque Function, each rank's own trace")


def test_a_given_plan_is_applied_to_rank_0s_graph_on_every_rank():
    x, y = make_batch("tokens", 8)
    plan = autopar.plan(MODEL(), autopar.Mesh(2), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                        mode="auto")
    ref = reference_run(MODEL, lm_loss, x, y, steps=2)
    results = run_ranks(2, _counting, MODEL, lm_loss, x, y, None, plan.to_json())
    assert [n for _, n in results] == [1, 0], "rank 1 should apply the plan to rank 0's graph, not trace"
    for r, _ in results:
        assert_same_training(ref, r, what="given plan, rank 0's graph on rank 1")


def _given_for_another_model(rank, plan_json):
    x, y = make_batch("tokens", 8)
    with pytest.raises(PlanError, match=r"made for a different model or input shapes \(graph fingerprint"):
        autopar.parallelize(MODEL(), autopar.Mesh(2), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                            plan=autopar.Plan.from_json(plan_json))
    return True


def test_a_given_plan_for_another_model_is_refused_on_every_rank():
    x, y = make_batch("tokens", 8)
    other = autopar.plan(functools.partial(GPT, qkv_bias=False, layers=1, hidden=32)(), autopar.Mesh(2),
                         example_inputs=(x,), loss_fn=lm_loss, example_target=y, mode="data")
    assert run_ranks(2, _given_for_another_model, other.to_json()) == [True, True]
