"""Context parallelism (issue 35): attention with q, k, v split along the sequence, both local
forms (all-gather K/V, ring), through the oracle: loss, gathered gradients before every SGD step
and parameters after it equal one-device training at 1e-5."""
from __future__ import annotations

import functools

import pytest
import torch

import autopar
from autopar import Shard
from autopar.collectives.attention_cp import causal_flops_per_rank, zigzag_chunks
import conftest
from cp_models import TinyGPT, encoder, token_loss, tokens
from oracle import LR, STEPS, _train, assert_same_training, make_optimizer, parallel_run, reference_run

BATCH = 2


def run_ranks(n: int, fn, *args) -> list:
    """``conftest.run_ranks`` with room for a loaded machine: each of these plans and trains a
    model on every rank (the pool's own limit is 120 s)."""
    return conftest._pool(n).run(conftest._fresh_call, fn, *args, timeout_s=600)


def _cp_input(model):
    autopar.shard_input(0, {"cp": Shard(1)})


def _dp_cp_input(model):
    autopar.shard_input(0, {"dp": Shard(0), "cp": Shard(1)})


def _cp_zigzag_input(model):
    """The zig-zag order asked for by name (HF models trace their causal mask as a tensor)."""
    autopar.shard_input(0, {"cp": Shard(1, 2, zigzag=True)})


def _hf_llama():
    """HF Llama: sdpa attention with its mask tensor, grouped-query heads (2 K/V heads), rotary."""
    from hf_zoo import llama

    torch.manual_seed(0)
    return llama(2, attn_implementation="sdpa", num_key_value_heads=2, max_position_embeddings=64)


def _attention(plan) -> list:
    return [n for n in plan.nodes.values() if "scaled_dot_product_attention" in n.op]


def _job(rank, model_fn, shape, names, form, pad, zigzag=False, batch=BATCH):
    """The solver's plan (``form`` None), or that plan with every sequence-split attention
    switched to ``form`` (run as given, HYBRID)."""
    x, y = tokens(batch, pad=pad)
    mesh = autopar.Mesh(shape, axis_names=names)
    kw, annotate = {}, _dp_cp_input if "dp" in names else _cp_zigzag_input if zigzag else _cp_input
    if form is not None:
        torch.manual_seed(0)
        annotate(None)
        plan = autopar.plan(model_fn(), mesh, example_inputs=(x,), loss_fn=token_loss, example_target=y,
                            mode="semi_auto")
        autopar.clear_annotations()
        for n in _attention(plan):
            n.local = [form if loc and loc.endswith(":cp") else loc for loc in n.local]
        kw = {"plan": plan}
    out = parallel_run(rank, model_fn, token_loss, x, y, mesh, "hybrid" if form else "semi_auto",
                       setup=None if form else annotate, **kw)
    out["attention"] = [n.local for n in _attention(autopar.Plan.from_json(out["plan"]))]
    return out


def _check(model_fn, shape, names, form, pad=0, ranks=4, zigzag=False, batch=BATCH):
    x, y = tokens(batch, pad=pad)
    ref = reference_run(model_fn, token_loss, x, y)
    results = run_ranks(ranks, _job, model_fn, shape, names, form, pad, zigzag, batch)
    for r in results:
        assert_same_training(ref, r, what=f"cp {shape} {form}")
    return results


def _zigzag(result) -> bool:
    """Whether the plan holds the sequence in the zig-zag order: the inputs and every attention's queries ``Z``."""
    plan = autopar.Plan.from_json(result["plan"])
    return (all(str(spec[plan.mesh.axis_names.index("cp")]) == "Z(1)" for spec in plan.inputs.values())
            and all(any(getattr(p, "zigzag", False) for p in n.inputs[0]) for n in _attention(plan)))


def _zigzag_positions(rank: int, n: int, seq: int) -> list[int]:
    """Chunks r and 2n-1-r of 2n, written out here."""
    c = seq // (2 * n)
    return list(range(rank * c, (rank + 1) * c)) + list(range((2 * n - 1 - rank) * c, (2 * n - rank) * c))


def _local_batch_job(rank, shape, names, form):
    """``_job``'s training fed with this rank's local batch, cut by ``pmodel.local_batch``: its rows
    over dp and its sequence pieces over cp (checked against the zig-zag positions written out);
    first the forward alone, its output gathered back into the sequence's order."""
    x, y = tokens(BATCH)
    mesh = autopar.Mesh(shape, axis_names=names)
    annotate = _dp_cp_input if "dp" in names else _cp_input
    torch.manual_seed(0)
    annotate(None)
    plan = autopar.plan(TinyGPT(), mesh, example_inputs=(x,), loss_fn=token_loss, example_target=y, mode="semi_auto")
    autopar.clear_annotations()
    for n in _attention(plan):
        n.local = [form if loc and loc.endswith(":cp") else loc for loc in n.local]
    torch.manual_seed(0)
    pmodel = autopar.parallelize(TinyGPT(), mesh, example_inputs=(x,), loss_fn=token_loss, example_target=y,
                                 mode="hybrid", plan=plan)
    torch.manual_seed(0)
    whole = TinyGPT()(x)
    got = pmodel(x)                      # forward only: the output gathered back from the zig-zag pieces
    assert torch.allclose(got, whole, rtol=1e-5, atol=1e-6), float((got - whole).abs().max())
    (xl,), yl = pmodel.local_batch(x, target=y)
    coords = dict(zip(names, mesh.coords(rank)))
    pos = _zigzag_positions(coords["cp"], shape[names.index("cp")], x.shape[1])
    rows = pmodel.local_batch_rows()
    assert torch.equal(xl, x[rows][:, pos]) and torch.equal(yl, y[rows][:, pos]), (rank, xl, pos)
    with pytest.raises(ValueError, match=r"this rank's part of the batch must be .*or, cut like local_batch\(\)"):
        pmodel.step(xl[:, :-1], target=yl, local_batch=True)
    opt = make_optimizer(pmodel.parameters(), "sgd", LR["sgd"])
    out = _train(lambda m: pmodel.step(xl, target=yl, local_batch=True), pmodel.full_state_dict,
                 pmodel.full_grad_dict, opt, STEPS)
    out["plan"] = pmodel.plan.to_json()
    out["attention"] = [n.local for n in _attention(pmodel.plan)]
    return out


def _check_local(shape, names, form):
    x, y = tokens(BATCH)
    ref = reference_run(TinyGPT, token_loss, x, y)
    results = run_ranks(4, _local_batch_job, shape, names, form)
    for r in results:
        assert_same_training(ref, r, what=f"cp {shape} {form}, local batches")
    return results


@pytest.mark.parametrize("form", [pytest.param("attn_gather:cp", marks=pytest.mark.slow), "attn_ring:cp"])
def test_gpt_causal_cp4_trains_like_one_device(form):
    """Causal attention: the sequence in the zig-zag order (rank r: chunks r, 2n-1-r of 2n), every
    input, position and the loss's rows cut alike. The ring form is fed local batches
    (``pmodel.local_batch``); the gather form the global batch."""
    results = _check_local((4,), ("cp",), form) if form == "attn_ring:cp" else _check(TinyGPT, (4,), ("cp",), form)
    used = results[0]["attention"]
    assert used and all(loc == [form] for loc in used), used
    assert _zigzag(results[0]), results[0]["plan"]


@pytest.mark.slow
@pytest.mark.parametrize("form", ["attn_gather:cp", "attn_ring:cp"])
def test_gpt_causal_with_padding_mask_cp4_in_the_zigzag_order(form):
    """A causal op with a key padding mask too: the mask's key dim gathered in the zig-zag order, its
    columns picked by the keys' positions."""
    results = _check(functools.partial(TinyGPT, pad_mask=True), (4,), ("cp",), form, pad=5)
    assert _zigzag(results[0]) and all(loc == [form] for loc in results[0]["attention"])


@pytest.mark.slow
def test_gpt_dp2_cp2_local_batches_in_the_zigzag_order():
    """The data helper on dp x cp: rows over dp, zig-zag sequence pieces over cp, trained as one device."""
    results = _check_local((2, 2), ("dp", "cp"), "attn_ring:cp")
    assert _zigzag(results[0])


@pytest.mark.slow
def test_gpt_cp2_tp2_zigzag_trains_like_one_device():
    results = _check(TinyGPT, (2, 2), ("cp", "tp"), None)
    assert _zigzag(results[0]), results[0]["plan"]



@pytest.mark.slow
@pytest.mark.parametrize("form", ["attn_gather:cp", "attn_ring:cp"])
def test_hf_llama_sdpa_gqa_rotary_cp4_trains_like_one_device(form):
    pytest.importorskip("transformers")
    used = _check(_hf_llama, (4,), ("cp",), form)[0]["attention"]
    assert used and all(loc == [form] for loc in used), used


@pytest.mark.slow
@pytest.mark.parametrize("form", ["attn_gather:cp", "attn_ring:cp"])
def test_hf_llama_rotary_cp4_in_the_zigzag_order_trains_like_one_device(form):
    """HF Llama's causal mask is a traced tensor (no is_causal flag), so the zig-zag order is asked for
    by annotation; its rotary cos/sin, built from arange positions, are cut in that order too."""
    pytest.importorskip("transformers")
    results = _check(_hf_llama, (4,), ("cp",), form, zigzag=True)
    used = results[0]["attention"]
    assert used and all(loc == [form] for loc in used), used
    assert _zigzag(results[0]), results[0]["plan"]


@pytest.mark.slow
def test_gpt_cp2_dp2_trains_like_one_device():
    """Enough rows (8) that splitting them over dp pays: with 2 the solver keeps the model whole on both
    dp ranks (the tokens gathered), and dp is never exercised."""
    results = _check(TinyGPT, (2, 2), ("dp", "cp"), None, batch=8)
    plan = autopar.Plan.from_json(results[0]["plan"])
    for n in _attention(plan):
        assert n.local == [None, "attn_gather:cp"] or n.local == [None, "attn_ring:cp"], n.local
    assert plan.params["tok.weight"].grad_sync == ["dp", "cp"] or set(plan.params["tok.weight"].grad_sync) == {"dp", "cp"}


@pytest.mark.parametrize("form", ["attn_gather:cp", pytest.param("attn_ring:cp", marks=pytest.mark.slow)])
def test_bidirectional_encoder_with_padding_mask_cp4_trains_like_one_device(form):
    used = _check(encoder, (4,), ("cp",), form, pad=5)[0]["attention"]
    assert used and all(loc == [form] for loc in used), used


def _op_job(rank, form, shape, causal, gqa, masked, zigzag=False, t=16):
    """One attention op: the local form on this rank's sequence piece (contiguous, or in the zig-zag
    order ``Z(-2)``) vs the whole op on one rank."""
    from autopar.collectives import comm, local_ops
    from autopar.collectives.groups import axis_groups, bound_axes
    from autopar.sharding.shard_params import local_piece

    mesh = autopar.Mesh(shape, axis_names=tuple(f"c{i}" for i in range(len(shape))))
    g = torch.Generator().manual_seed(0)
    b, h, d = 2, 4, 8
    hk = 2 if gqa else h
    q, k, v = (torch.randn(b, n, t, d, generator=g, dtype=torch.float64) for n in (h, hk, hk))
    mask = torch.rand(b, 1, t, t, generator=g) > 0.3 if masked else None
    if mask is not None:
        mask[..., 0] = True
    full = [z.clone().requires_grad_() for z in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*full, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    grad_out = torch.randn(out.shape, generator=g, dtype=out.dtype)
    out.backward(grad_out)
    spec = tuple(Shard(-2, 2, True) if zigzag else Shard(-2) for _ in shape)

    def mine(z):
        return local_piece(z, spec, mesh.coords(rank), shape)

    local = [mine(z).clone().requires_grad_() for z in (q, k, v)]
    kw = {"_zigzag": True} if zigzag else {}
    with bound_axes(axis_groups(mesh)), comm.count_collectives() as counter:
        o = local_ops.IMPLS[form](*local, None if mask is None else mine(mask), 0.0, causal,
                                  enable_gqa=gqa, _op="scaled_dot_product_attention", _axes={"cp": list(mesh.axis_names)},
                                  **kw)
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


@pytest.mark.slow
@pytest.mark.parametrize("form", ["attn_gather", "attn_ring"])
def test_attention_op_forms_in_the_zigzag_order_match_the_whole_op(form):
    """Both forms with the sequence in the zig-zag order (rank r: chunks r and 2n-1-r): causal on one
    axis and on two (the outer one gathered first), GQA, and a causal op with a mask as well."""
    for shape, causal, gqa, masked in [((4,), True, False, False), ((2, 2), True, True, False),
                                       ((4,), True, False, True)]:
        for out_err, grad_errs, calls in run_ranks(4, _op_job, form, shape, causal, gqa, masked, True):
            assert out_err < 1e-10 and max(grad_errs) < 1e-10, (form, shape, causal, gqa, masked, out_err, grad_errs)
            assert calls > 0


def test_zigzag_split_balances_causal_attention_within_ten_percent():
    """Per-rank work of causal attention: the zig-zag order (rank r: chunks r, 2n-1-r) is balanced
    within 10 %; the contiguous split and ``Shard(dim, chunks=2)``'s order (r, n+r) are not."""
    seq, d = 1024, 64
    whole = causal_flops_per_rank(seq, [[0]], 1, d)[0]
    assert whole == 2 * d * seq * (seq + 1) // 2
    for n in (2, 4, 8):
        zigzag = causal_flops_per_rank(seq, [list(zigzag_chunks(r, n)) for r in range(n)], 2 * n, d)
        contiguous = causal_flops_per_rank(seq, [[r] for r in range(n)], n, d)
        blockwise = causal_flops_per_rank(seq, [[r, n + r] for r in range(n)], 2 * n, d)
        for split in (zigzag, contiguous, blockwise):
            assert sum(split) == whole
        assert max(zigzag) <= 1.1 * min(zigzag), zigzag
        assert max(contiguous) > 1.5 * min(contiguous) and max(blockwise) > 1.1 * min(blockwise)


def test_a_sequence_the_cp_axis_does_not_divide_is_a_clear_error():
    x, y = tokens(BATCH)
    x, y = x[:, :62], y[:, :62]
    with pytest.raises(Exception, match=r"sequence \(62, dim 1 of .*context-parallel size 4.*multiple of 4"):
        autopar.plan(TinyGPT(), autopar.Mesh(4, axis_names=("cp",)), example_inputs=(x,), loss_fn=token_loss,
                     example_target=y, mode="semi_auto")


def _kept_job(rank, form):
    """cp 4 with recompute="except_attention": each layer recomputes around its attention, whose local form
    (``form``) runs once, outside both checkpointed parts."""
    x, y = tokens(BATCH)
    mesh = autopar.Mesh((4,), axis_names=("cp",))
    torch.manual_seed(0)
    _cp_input(None)
    autopar.set_auto_parallel_context(recompute="except_attention")
    try:
        plan = autopar.plan(TinyGPT(), mesh, example_inputs=(x,), loss_fn=token_loss, example_target=y,
                            mode="semi_auto")
    finally:
        autopar.clear_annotations()
        autopar.reset_auto_parallel_context()
    for n in _attention(plan):
        n.local = [form if loc and loc.endswith(":cp") else loc for loc in n.local]

    def regions(pm):
        gm = pm.program.gm
        return pm.code, [gm.get_submodule(f"recompute_blocks_0_part_{i}").body.code for i in (0, 1)]

    return parallel_run(rank, TinyGPT, token_loss, x, y, mesh, "hybrid", plan=plan, inspect=regions)


@pytest.mark.parametrize("form", ["attn_gather:cp", "attn_ring:cp"])
def test_cp4_recompute_except_attention_trains_like_one_device(form):
    x, y = tokens(BATCH)
    ref = reference_run(TinyGPT, token_loss, x, y)
    results = run_ranks(4, _kept_job, form)
    fn = "attention_gather(" if form.startswith("attn_gather") else "attention_ring("
    for r in results:
        assert_same_training(ref, r, what=f"cp 4 {form} except_attention")
        code, parts = r["inspect"]
        assert "self.recompute_blocks_0_part_0(" in code and fn in code, code
        assert all(fn not in body and "linear" in body for body in parts)


def _zero3_job(rank, recompute):
    """cp 4 with ZeRO-3 (the parameters, replicated on cp, sharded over it and gathered per layer) and each
    layer recomputed (``recompute``)."""
    x, y = tokens(BATCH)
    mesh = autopar.Mesh((4,), axis_names=("cp",))

    def setup(model):
        _cp_input(model)
        autopar.set_auto_parallel_context(zero=3, recompute=recompute)

    try:
        return parallel_run(rank, TinyGPT, token_loss, x, y, mesh, "semi_auto", setup=setup)
    finally:
        autopar.clear_annotations()
        autopar.reset_auto_parallel_context()


@pytest.mark.parametrize("recompute", ["full", "except_attention"])
def test_cp4_zero3_with_recomputation_trains_like_one_device(recompute):
    x, y = tokens(BATCH)
    ref = reference_run(TinyGPT, token_loss, x, y)
    results = run_ranks(4, _zero3_job, recompute)
    for r in results:
        assert_same_training(ref, r, what=f"cp 4, ZeRO-3, recompute {recompute}")
    plan = autopar.Plan.from_json(results[0]["plan"])
    assert plan.memory_options.zero == 3 and plan.memory_options.recompute == recompute and plan.degrees["cp"] == 4
    # ZeRO-3 gathers each layer's weights before its forward and again before its backward
    weights = {d.placeholder for d in plan.params.values()}
    gathered = {(c.phase, c.node) for c in plan.collective_list if c.kind == "all_gather" and c.node in weights}
    assert {"fwd", "bwd"} <= {phase for phase, _ in gathered}, sorted(gathered)
