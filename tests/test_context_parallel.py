"""Context parallelism (issue 35): attention with q, k, v split along the sequence, both local
forms (all-gather K/V, ring), through the oracle: loss, gathered gradients before every SGD step
and parameters after it equal one-device training at 1e-5."""
from __future__ import annotations

import contextlib

import pytest

import autopar
from autopar import Shard
from autopar.collectives.attention_cp import causal_flops_per_rank, zigzag_chunks
from autopar.sharding.rules import attention
from conftest import run_ranks
from cp_models import TinyGPT, encoder, token_loss, tokens
from oracle import assert_same_training, parallel_run, reference_run

BATCH = 2


@contextlib.contextmanager
def only_form(form: str | None):
    """Offer one local form of the sequence split (None: both, the solver picks)."""
    saved = attention.CP_FORMS
    if form is not None:
        attention.CP_FORMS = (form,)
    try:
        yield
    finally:
        attention.CP_FORMS = saved


def _cp_input(model):
    autopar.shard_input(0, {"cp": Shard(1)})


def _job(rank, model_fn, shape, names, form, pad):
    x, y = tokens(BATCH, pad=pad)
    mesh = autopar.Mesh(shape, axis_names=names)
    with only_form(form):
        out = parallel_run(rank, model_fn, token_loss, x, y, mesh, "semi_auto", setup=_cp_input,
                           inspect=lambda pm: [n.local for n in pm.plan.nodes.values()
                                               if "scaled_dot_product_attention" in n.op])
    return out


def _check(model_fn, shape, names, form, pad=0, ranks=4):
    x, y = tokens(BATCH, pad=pad)
    ref = reference_run(model_fn, token_loss, x, y)
    results = run_ranks(ranks, _job, model_fn, shape, names, form, pad)
    for r in results:
        assert_same_training(ref, r, what=f"cp {shape} {form}")
    return results


@pytest.mark.parametrize("form", ["attn_gather:cp", "attn_ring:cp"])
def test_gpt_causal_cp4_trains_like_one_device(form):
    results = _check(TinyGPT, (4,), ("cp",), form)
    used = results[0]["inspect"]
    assert used and all(loc == [form] for loc in used), used
