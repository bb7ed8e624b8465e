"""``recompute_layers=k`` (``graph/recompute_layers.py``): "full" on k of the layers, the others kept,
trains like one device (the oracle: SGD with momentum, losses, gathered gradients and parameters within
1e-5) on 2 data-parallel ranks and, slow, on a 2-stage pipeline where each stage recomputes its first
layer only."""
from __future__ import annotations

import functools

import pytest

import autopar
import conftest
from examples.models import GPT, lm_loss
from oracle import assert_same_training, make_batch, parallel_run, reference_run

DEVICE = "a100-80gb"
VOCAB, SEQ = 64, 8


def _tokens():
    return make_batch("tokens", 8, vocab=VOCAB, seq=SEQ)


def _gpt(layers):
    return functools.partial(GPT, vocab=VOCAB, hidden=16, heads=2, layers=layers, seq=SEQ, qkv_bias=False)


def run_ranks(n: int, fn, *args) -> list:
    """``conftest.run_ranks`` with room for a loaded machine (the pool's own limit is 120 s)."""
    return conftest._pool(n).run(conftest._fresh_call, fn, *args, timeout_s=600)


def _plan(layers: int, k: int, pipeline: bool):
    x, y = _tokens()
    autopar.reset_auto_parallel_context()
    ctx = dict(recompute_layers=k)
    if pipeline:
        ctx.update(schedule="1f1b", microbatches=2)
    autopar.set_auto_parallel_context(**ctx)
    mesh = autopar.Mesh(2, axis_names=("pp",) if pipeline else ("dp",), device=DEVICE)
    try:
        plan = autopar.plan(_gpt(layers)(), mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                            mode="auto" if pipeline else "data")
    finally:
        autopar.reset_auto_parallel_context()
    return plan, mesh


def _job(rank, plan_json, mesh, layers):
    x, y = _tokens()
    plan = autopar.Plan.from_json(plan_json)
    return parallel_run(rank, _gpt(layers), lm_loss, x, y, mesh, None, plan=plan, steps=2, inspect=lambda pm: pm.code)


def _check(layers: int, k: int, pipeline: bool, want: dict):
    plan, mesh = _plan(layers, k, pipeline)
    assert plan.memory_options.recompute == want
    x, y = _tokens()
    ref = reference_run(_gpt(layers), lm_loss, x, y, steps=2)
    results = run_ranks(2, _job, plan.to_json(), mesh, layers)
    for r in results:
        assert_same_training(ref, r, what=f"recompute_layers={k} of {layers}")
    return results


def test_one_of_two_layers_recomputed_trains_like_one_device():
    results = _check(2, 1, False, {"blocks.0": "full"})
    code = results[0]["inspect"]
    assert "self.recompute_blocks_0(" in code and "recompute_blocks_1" not in code


@pytest.mark.slow
def test_pipeline_stages_recompute_their_first_layer():
    """4 layers on 2 stages, k = 2: blocks.0 on stage 0 and blocks.2 on stage 1 recompute."""
    results = _check(4, 2, True, {"blocks.0": "full", "blocks.2": "full"})
    stage_code = [r["inspect"] for r in results]      # each rank's stage
    recomputed = sorted(name for code in stage_code for name in ("blocks_0", "blocks_1", "blocks_2", "blocks_3")
                        if f"self.recompute_{name}(" in code)
    assert recomputed == ["blocks_0", "blocks_2"], recomputed
