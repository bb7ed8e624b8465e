"""Interleaved 1F1B with four virtual stages per rank (pp 2 x v 4 on an 8-layer GPT) trains like one
device (the oracle: SGD with momentum, losses, gathered gradients and parameters within 1e-5)."""
from __future__ import annotations

import functools

import autopar
import conftest
from examples.models import GPT, lm_loss
from oracle import assert_same_training, make_batch, parallel_run, reference_run

GPT8 = functools.partial(GPT, qkv_bias=False, layers=8, hidden=32)


def _job(rank, ctx):
    autopar.set_auto_parallel_context(**ctx)
    x, y = make_batch("tokens", 8)
    return parallel_run(rank, GPT8, lm_loss, x, y, autopar.Mesh((2,), axis_names=("pp",)), "auto")


def _check(ctx, v):
    x, y = make_batch("tokens", 8)
    ref = reference_run(GPT8, lm_loss, x, y)
    results = conftest._pool(2).run(conftest._fresh_call, _job, ctx, timeout_s=600)
    for r, res in enumerate(results):
        assert_same_training(ref, res, what=f"gpt8 pp 2 rank {r}")
    plan = autopar.Plan.from_json(results[0]["plan"])
    assert (plan.schedule, plan.microbatches, plan.pipeline.virtual_stages) == ("interleaved_1f1b", 4, v)
    assert [s.ranks for s in plan.stages] == [[0], [1]] * v
    return plan


def test_pp2_v4_interleaved_trains_like_one_device():
    _check({"virtual_stages": 4, "microbatches": 4}, 4)
