"""Context parallelism (issue 35): attention with q, k, v split along the sequence, both local
forms (all-gather K/V, ring), through the oracle: loss, gathered gradients before every SGD step
and parameters after it equal one-device training at 1e-5."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar import Shard
from autopar.collectives.attention_cp import causal_flops_per_rank, zigzag_chunks
from conftest import run_ranks
from cp_models import TinyGPT, encoder, token_loss, tokens
from oracle import assert_same_training, parallel_run, reference_run

BATCH = 2


def _cp_input(model):
    autopar.shard_input(0, {"cp": Shard(1)})


def _attention(plan) -> list:
    return [n for n in plan.nodes.values() if "scaled_dot_product_attention" in n.op]


def _job(rank, model_fn, shape, names, form, pad):
    """The solver's plan (``form`` None), or that plan with every sequence-split attention
    switched to ``form`` (run as given, HYBRID)."""
    x, y = tokens(BATCH, pad=pad)
    mesh = autopar.Mesh(shape, axis_names=names)
    kw = {}
    if form is not None:
        torch.manual_seed(0)
        _cp_input(None)
        plan = autopar.plan(model_fn(), mesh, example_inputs=(x,), loss_fn=token_loss, example_target=y,
                            mode="semi_auto")
        autopar.clear_annotations()
        for n in _attention(plan):
            n.local = [form if loc and loc.endswith(":cp") else loc for loc in n.local]
        kw = {"plan": plan}
    out = parallel_run(rank, model_fn, token_loss, x, y, mesh, "hybrid" if form else "semi_auto",
                       setup=None if form else _cp_input, **kw)
    out["attention"] = [n.local for n in _attention(autopar.Plan.from_json(out["plan"]))]
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
    used = results[0]["attention"]
    assert used and all(loc == [form] for loc in used), used


def _op_job(rank, form, shape, causal, gqa, masked):
    """One attention op: the local form on this rank's sequence piece vs the whole op on one rank."""
    from autopar.collectives import comm, local_ops
    from autopar.collectives.groups import axis_groups, bound_axes

    mesh = autopar.Mesh(shape, axis_names=tuple(f"c{i}" for i in range(len(shape))))
    g = torch.Generator().manual_seed(0)
    b, h, t, d = 2, 4, 16, 8
    hk = 2 if gqa else h
    q, k, v = (torch.randn(b, n, t, d, generator=g, dtype=torch.float64) for n in (h, hk, hk))
    mask = torch.rand(b, 1, t, t, generator=g) > 0.3 if masked else None
    if mask is not None:
        mask[..., 0] = True
    full = [z.clone().requires_grad_() for z in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*full, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    grad_out = torch.randn(out.shape, generator=g, dtype=out.dtype)
    out.backward(grad_out)
    n = 1
    for s in shape:
        n *= s
    coords = mesh.coords(rank)
    piece = 0
    for c, s in zip(coords, shape):
        piece = piece * s + c

    def mine(z):
        return z.chunk(n, -2)[piece]

    local = [mine(z).clone().requires_grad_() for z in (q, k, v)]
    with bound_axes(axis_groups(mesh)), comm.count_collectives() as counter:
        o = local_ops.IMPLS[form](*local, None if mask is None else mask.chunk(n, -2)[piece], 0.0, causal,
                                  enable_gqa=gqa, _op="scaled_dot_product_attention", _axes={"cp": list(mesh.axis_names)})
        o.backward(mine(grad_out))
    errs = [float((mine(f.grad) - l.grad).abs().max()) for f, l in zip(full, local)]
    return float((o - mine(out)).abs().max()), errs, len(counter.calls)


@pytest.mark.parametrize("form", ["attn_gather", "attn_ring"])
def test_attention_op_forms_match_the_whole_op(form):
    for shape, causal, gqa, masked in [((4,), True, False, False), ((2, 2), True, True, False),
                                       ((4,), False, True, True)]:
        for out_err, grad_errs, calls in run_ranks(4, _op_job, form, shape, causal, gqa, masked):
            assert out_err < 1e-10 and max(grad_errs) < 1e-10, (form, shape, causal, gqa, masked, out_err, grad_errs)
            assert calls > 0
