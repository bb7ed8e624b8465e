"""The embedding and the head as model stages of their own (``solver/end_units.py``) train like one
device: pp 2 with v chosen so that pp x v = layers + 2, every unit a chunk (the oracle: SGD with
momentum, losses, gathered gradients and parameters within 1e-5). The GPT ties its embedding to its
head, so the tied weight lives on both ranks."""
from __future__ import annotations

import functools

import pytest

import autopar
import conftest
from autopar.graph.cut_points import EMBEDDING, HEAD
from examples.models import GPT, Llama, lm_loss
from oracle import assert_same_training, make_batch, parallel_run, reference_run

MODELS = {"gpt2": functools.partial(GPT, qkv_bias=False, layers=2, hidden=32),
          "llama6": functools.partial(Llama, hidden=32, layers=6, ffn=64)}


def _job(rank, name, ctx):
    autopar.set_auto_parallel_context(**ctx)
    x, y = make_batch("tokens", 8)
    return parallel_run(rank, MODELS[name], lm_loss, x, y, autopar.Mesh((2,), axis_names=("pp",)), "auto")


def _check(name, v):
    x, y = make_batch("tokens", 8)
    ref = reference_run(MODELS[name], lm_loss, x, y)
    ctx = {"virtual_stages": v, "microbatches": 4}
    results = conftest._pool(2).run(conftest._fresh_call, _job, name, ctx, timeout_s=600)
    for r, res in enumerate(results):
        assert_same_training(ref, res, what=f"{name} pp 2 v {v} rank {r}")
    plan = autopar.Plan.from_json(results[0]["plan"])
    assert (plan.schedule, plan.pipeline.virtual_stages) == ("interleaved_1f1b", v)
    assert plan.stages[0].layers == [EMBEDDING] and plan.stages[-1].layers == [HEAD]
    assert [s.ranks for s in plan.stages] == [[0], [1]] * v


def test_embedding_and_head_chunks_train_like_one_device():
    _check("gpt2", 2)


@pytest.mark.slow
def test_llama_at_v_of_layers_plus_two_over_pp_trains_like_one_device():
    _check("llama6", 4)
