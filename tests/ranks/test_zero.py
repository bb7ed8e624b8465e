"""ZeRO stages 1, 2 and 3 (``plan.memory_options.zero``, runtime/zero.py): a DATA plan on 2 ranks and a
(dp, tp) plan on 4 ranks forced to a stage train like one process (the oracle) with SGD and AdamW,
with accumulation and clipping; a rank holds 1/d of the optimizer state (and, at stage 2, of the
gradients, at stage 3 also of the parameters between uses); ZeRO-3 gathers per layer and re-gathers
in backward; checkpoints round-trip; ZeRO-2 and 3 with a pipeline are refused clearly (ZeRO-1 with one:
tests/ranks/test_pipeline_zero.py)."""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import autopar
from conftest import run_ranks
from examples.models import GPT, MLP, lm_loss
from oracle import adamw_steps, assert_same_training, make_batch, parallel_run, reference_run

GPT_SMALL = functools.partial(GPT, vocab=64, hidden=32, heads=2, layers=1, seq=8, qkv_bias=False)
CASES = {
    "mlp": (MLP, F.cross_entropy, "vector", {}),
    "gpt": (GPT_SMALL, lm_loss, "tokens", {"vocab": 64, "seq": 8}),
}


BATCH = {"dp2": 8, "dp2tp2": 64}     # at 8 samples the (dp, tp) plan leaves dp unused (degrees dp=1)


def _with_zero(plan, zero: int):
    return dataclasses.replace(plan, memory_options=dataclasses.replace(plan.memory_options, zero=zero))


def _mlp_tp(model):
    autopar.shard({"layers.0": ColwiseParallel(), "layers.1": RowwiseParallel()}, axis="tp")


@functools.lru_cache(maxsize=None)
def _plan_json(name: str, mesh_key: str, zero: int, micro: int) -> str:
    """A DATA plan on 2 ranks, or a (dp=2, tp=2) Megatron MLP plan on 4, with ``zero`` forced."""
    model_fn, loss_fn, kind, kw = CASES[name]
    x, y = make_batch(kind, BATCH[mesh_key], **kw)
    x, y = x[: BATCH[mesh_key] // micro], y[: BATCH[mesh_key] // micro]
    torch.manual_seed(0)
    model = model_fn()
    if mesh_key == "dp2":
        plan = autopar.plan(model, autopar.Mesh(2), example_inputs=(x,), loss_fn=loss_fn, example_target=y,
                            mode="data")
    else:
        autopar.clear_annotations()
        _mlp_tp(model)
        mesh = autopar.Mesh((2, 2), axis_names=("dp", "tp"), device="a100-80gb")
        plan = autopar.plan(model, mesh, example_inputs=(x,), loss_fn=loss_fn, example_target=y, mode="semi_auto")
        autopar.clear_annotations()
    return _with_zero(plan, zero).to_json()


def _zero_job(rank, name, plan_json, optim, micro, clip, batch):
    model_fn, loss_fn, kind, kw = CASES[name]
    x, y = make_batch(kind, batch, **kw)
    plan = autopar.Plan.from_json(plan_json)
    return parallel_run(rank, model_fn, loss_fn, x, y, plan.mesh, None, plan=plan, optim=optim, micro=micro,
                        clip=clip)


RUNS = [  # (model, mesh, zero, optimizer, micro-batches, clip)
    ("mlp", "dp2", 1, "sgd", 2, 0.5),
    ("mlp", "dp2", 1, "adamw", 1, None),
    ("mlp", "dp2", 2, "sgd", 1, None),
    ("mlp", "dp2", 2, "adamw", 2, 0.5),
    ("gpt", "dp2", 2, "sgd", 2, 1.0),       # tied embedding, layer norms, uneven chunks (padding)
    ("gpt", "dp2", 1, "adamw", 1, 1.0),
    ("mlp", "dp2tp2", 1, "adamw", 2, 0.5),
    ("mlp", "dp2tp2", 2, "sgd", 2, 0.5),
    ("mlp", "dp2", 3, "sgd", 2, 0.5),
    ("gpt", "dp2", 3, "adamw", 2, 1.0),
    ("gpt", "dp2", 3, "sgd", 1, None),
    ("mlp", "dp2tp2", 3, "adamw", 2, 0.5),
]


@pytest.mark.parametrize("name,mesh_key,zero,optim,micro,clip", RUNS)
def test_zero_trains_like_one_process(name, mesh_key, zero, optim, micro, clip):
    model_fn, loss_fn, kind, kw = CASES[name]
    x, y = make_batch(kind, BATCH[mesh_key], **kw)
    ref = reference_run(model_fn, loss_fn, x, y, optim=optim, micro=micro, clip=clip)
    n = 2 if mesh_key == "dp2" else 4
    plan_json = _plan_json(name, mesh_key, zero, micro)
    plan = autopar.Plan.from_json(plan_json)
    dp_axis = "d0" if mesh_key == "dp2" else "dp"
    assert all(d.grad_sync == [dp_axis] for d in plan.params.values()), "every parameter must be sharded over dp"
    if mesh_key == "dp2tp2":
        assert plan.degrees["dp"] == 2 and plan.degrees["tp"] == 2
    results = run_ranks(n, _zero_job, name, plan_json, optim, micro, clip, BATCH[mesh_key])
    for r in results:
        assert autopar.Plan.from_json(r["plan"]).memory_options.zero == zero
        assert_same_training(ref, r, what=f"{name} {mesh_key} zero={zero} {optim} micro={micro} clip={clip}")


def _memory_job(rank, plan_jsons):
    x, y = make_batch("tokens", 8, vocab=64, seq=8)
    out = {}
    for zero, js in plan_jsons.items():
        torch.manual_seed(0)
        pmodel = autopar.parallelize(GPT_SMALL(), autopar.Mesh(2), example_inputs=(x,), loss_fn=lm_loss,
                                     example_target=y, plan=autopar.Plan.from_json(js))
        opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
        pmodel.step(x, target=y)
        opt.step()
        pmodel.step(x, target=y)     # gradients held between backward and the next optimizer step
        state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0)
        grads = sum(p.grad.numel() * p.grad.element_size() for p in pmodel.program.parameters() if p.grad is not None)
        params = sum(p.numel() * p.element_size() for p in pmodel.program.parameters())
        if pmodel._zero is not None:
            grads, params = pmodel._zero.held_bytes()["grads"], pmodel._zero.held_bytes()["params"]
        out[zero] = {"state": state, "grads": grads, "params": params}
    return out


def test_optimizer_state_and_gradients_held_per_rank_are_one_over_d():
    js = {z: _plan_json("gpt", "dp2", z, 1) for z in (0, 1, 2, 3)}
    for r in run_ranks(2, _memory_job, js):
        full_state, full_grads, full_params = r[0]["state"], r[0]["grads"], r[0]["params"]
        # chunks are padded to a multiple of d: at most d - 1 elements per tensor more than 1/d
        for z in (1, 2, 3):
            assert full_state / 2 <= r[z]["state"] <= full_state / 2 + 2 * 4 * 64, (z, r)
        # stage 1 keeps full-size gradient buffers; its shards' gradients are views of them
        assert full_grads <= r[1]["grads"] <= full_grads + 4 * 64, r
        for z in (2, 3):
            assert full_grads / 2 <= r[z]["grads"] <= full_grads / 2 + 4 * 64, (z, r)
        # parameters: full at stages 1 and 2 (their shards view them), 1/d between uses at stage 3
        for z in (1, 2):
            assert full_params <= r[z]["params"] <= full_params + 4 * 64, (z, r)
        assert full_params / 2 <= r[3]["params"] <= full_params / 2 + 4 * 64, r


def _checkpoint_job(rank, plan_json, path):
    x, y = make_batch("tokens", 8, vocab=64, seq=8)
    plan = autopar.Plan.from_json(plan_json)

    def build():
        torch.manual_seed(rank + 1)      # different initial values: the load must overwrite them
        pm = autopar.parallelize(GPT_SMALL(), autopar.Mesh(2), example_inputs=(x,), loss_fn=lm_loss,
                                 example_target=y, plan=plan)
        return pm, torch.optim.AdamW(pm.parameters(), lr=1e-3)

    a, opt_a = build()
    a.load_full_state_dict(a.full_state_dict())     # shards re-cut from the loaded working parameters
    for _ in range(2):
        a.step(x, target=y)
        opt_a.step()
        opt_a.zero_grad()
    a.save(path, opt_a)
    b, opt_b = build()
    b.load(path, opt_b)
    for pm, opt in ((a, opt_a), (b, opt_b)):
        pm.step(x, target=y)
        opt.step()
    sa, sb = a.full_state_dict(), b.full_state_dict()
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa)


@pytest.mark.parametrize("zero", [2, 3])
def test_checkpoint_round_trip_keeps_sharded_optimizer_state(tmp_path, zero):
    for diff in run_ranks(2, _checkpoint_job, _plan_json("gpt", "dp2", zero, 1), str(tmp_path / "ckpt")):
        assert diff == 0.0


def test_zero_with_a_pipeline_is_refused_with_a_clear_error():
    from autopar.runtime.zero import check_zero_supported

    plan = _with_zero(autopar.Plan.from_json(_plan_json("mlp", "dp2", 0, 1)), 2)
    with pytest.raises(autopar.PlanError, match=r"zero=2 is not supported with a pipeline"):
        check_zero_supported(plan, pipelined=True)
    check_zero_supported(plan, pipelined=False)


def _policy_job(rank, plan_jsons):
    x, y = make_batch("tokens", 8, vocab=64, seq=8)
    out = []
    for js in plan_jsons:
        torch.manual_seed(0)
        pm = autopar.parallelize(GPT_SMALL(), autopar.Mesh(2), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                                 plan=autopar.Plan.from_json(js))
        out.append(adamw_steps(pm, x, y))
    return out


@pytest.mark.parametrize("zero,policy", [(2, "bf16 compute"), (2, "bf16 on the wire"),
                                         (3, "bf16 compute"),
                                         (3, "recompute full")])
def test_zero_under_mixed_precision_and_compression_matches_zero0(zero, policy):
    """bf16 compute on fp32 masters (shards cut from the masters; ZeRO-3 gathers the bf16 copies)
    and bf16 gradient compression (the reduce-scatter runs in bf16, as DDP's hook all-reduces):
    ZeRO trains like ZeRO-0."""
    x, y = make_batch("tokens", 8, vocab=64, seq=8)
    torch.manual_seed(0)
    plan = autopar.plan(GPT_SMALL(), autopar.Mesh(2), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                        mode="data", mixed_precision="bf16" if policy == "bf16 compute" else None)
    if policy == "bf16 on the wire":
        plan = dataclasses.replace(plan, grad_compression="bf16")
    if policy == "recompute full":      # gathered weights enter the checkpointed regions as inputs
        plan = dataclasses.replace(plan, memory_options=dataclasses.replace(plan.memory_options, recompute="full"))
    (a, sa), (b, sb) = run_ranks(2, _policy_job, [_with_zero(plan, z).to_json() for z in (0, zero)])[0]
    assert a == pytest.approx(b, rel=1e-3)
    for k in sa:
        assert torch.allclose(sa[k], sb[k], rtol=1e-2, atol=1e-3), k


def _zero3_collectives_job(rank, plan_json):
    x, y = make_batch("tokens", 8, vocab=64, seq=8)
    torch.manual_seed(0)
    pm = autopar.parallelize(GPT_SMALL(), autopar.Mesh(2), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                             plan=autopar.Plan.from_json(plan_json))
    with autopar.count_collectives() as c:
        pm.step(x, target=y)
    with torch.no_grad():
        out = pm(x)                    # forward only: the same gathers, nothing saved
    return dict(c.summary()), [m.names for m in pm._zero.mods], pm.code, out


def test_zero3_gathers_each_layer_before_use_and_again_in_backward():
    x, _ = make_batch("tokens", 8, vocab=64, seq=8)
    torch.manual_seed(0)
    want = GPT_SMALL()(x).detach()
    calls, units, code, out = run_ranks(2, _zero3_collectives_job, _plan_json("gpt", "dp2", 3, 1))[0]
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6)
    # units: wte (tied with the LM head), wpe, the block, ln_f: one gather each in forward, one
    # reduce-scatter each in backward; backward re-gathers the units whose gathered weights autograd
    # saved (all but wpe: an embedding's backward needs only the indices)
    assert [u[0] for u in units] == ["wte.weight", "wpe.weight", "blocks.0.fc1.bias", "ln_f.bias"]
    assert calls[("all_gather", "d0", "fwd")] == 4 and calls[("reduce_scatter", "d0", "bwd")] == 4
    assert calls[("all_gather", "d0", "bwd")] == 3
    assert ("all_reduce", "d0", "bwd") not in calls
    assert code.index("zero3_gather_2") > code.index("embedding")       # gathered where first used


def _zeroed_job(rank, plan_json):
    x, y = make_batch("tokens", 8, vocab=64, seq=8)
    torch.manual_seed(0)
    pm = autopar.parallelize(GPT_SMALL(), autopar.Mesh(2), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                             plan=autopar.Plan.from_json(plan_json))
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    with pm.no_sync():
        pm.step(x, target=y)
    opt.zero_grad()             # discards the no_sync step's gradient, as on one device
    pm.step(x, target=y)
    return pm.full_grad_dict()


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_grad_between_accumulation_steps_discards_the_local_gradients(zero):
    x, y = make_batch("tokens", 8, vocab=64, seq=8)
    torch.manual_seed(0)
    model = GPT_SMALL()
    lm_loss(model(x), y).backward()
    for grads in run_ranks(2, _zeroed_job, _plan_json("gpt", "dp2", zero, 1)):
        for name, p in model.named_parameters():
            assert torch.allclose(grads[name], p.grad, rtol=1e-4, atol=1e-6), (zero, name)


def _plan_accumulation_job(rank, plan_json):
    x, y = make_batch("tokens", 8, vocab=64, seq=8)
    plan = autopar.Plan.from_json(plan_json)
    return parallel_run(rank, GPT_SMALL, lm_loss, x, y, plan.mesh, None, plan=plan, micro=2, clip=0.5)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_with_plan_accumulation_trains_like_one_process(zero):
    """The plan's own accumulation (k microbatches per step, under no_sync until the last) nested
    in the user's (micro=2 step() calls per optimizer step)."""
    x, y = make_batch("tokens", 8, vocab=64, seq=8)
    autopar.set_auto_parallel_context(accumulation=2)
    torch.manual_seed(0)
    plan = autopar.plan(GPT_SMALL(), autopar.Mesh(2), example_inputs=(x[:4],), loss_fn=lm_loss,
                        example_target=y[:4], mode="data")
    autopar.reset_auto_parallel_context()
    assert plan.memory_options.accumulation == 2
    ref = reference_run(GPT_SMALL, lm_loss, x, y, micro=2, clip=0.5)
    for r in run_ranks(2, _plan_accumulation_job, _with_zero(plan, zero).to_json()):
        assert_same_training(ref, r, what=f"zero={zero} with plan accumulation 2")


def _zero2_backward_job(rank):
    model_fn = functools.partial(GPT_SMALL, layers=2)
    x, y = make_batch("tokens", 8, vocab=64, seq=8)
    torch.manual_seed(0)
    plan = _with_zero(autopar.plan(model_fn(), autopar.Mesh(2), example_inputs=(x,), loss_fn=lm_loss,
                                   example_target=y, mode="data"), 2)
    pm = autopar.parallelize(model_fn(), plan.mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, plan=plan)
    seen = []
    with autopar.count_collectives() as counter:
        # the embedding's gradient is the last of the backward: the blocks' buckets went before it
        pm._zero.working("wte.weight").register_post_accumulate_grad_hook(
            lambda _: seen.append(sum(kind == "reduce_scatter" for kind, *_ in counter.calls)))
        pm.step(x, target=y)
    held = [n for n, (_, sp) in pm._zero.sharded.items() if sp.working.grad is not None]
    return {"before_embedding": seen, "reduce_scatters": sum(kind == "reduce_scatter" for kind, *_ in counter.calls),
            "held": held, "buckets": sum(len(s.buckets) for s in pm._zero.sets)}


def test_zero2_reduce_scatters_each_layer_during_backward():
    """ZeRO-2 keeps gradients sharded through backward (DeepSpeed's stage 2, FSDP2's reduce-scatter per
    module): a layer's bucket is reduce-scattered as soon as its last gradient is accumulated, and no
    working gradient survives the step."""
    for r in run_ranks(2, _zero2_backward_job):
        assert r["buckets"] >= 4, r                 # one per layer at least: blocks.0, blocks.1, wte, wpe, ln_f
        assert r["reduce_scatters"] == r["buckets"], r
        assert r["before_embedding"] and r["before_embedding"][0] >= 2, r
        assert r["held"] == [], r


def _bf16_grads_job(rank, plan_json):
    x, y = make_batch("tokens", 8, vocab=64, seq=8)
    return parallel_run(rank, GPT_SMALL, lm_loss, x, y, autopar.Mesh(2), "data", steps=1, lr=1e-2, optim="adamw",
                        plan=autopar.Plan.from_json(plan_json))["grads"][0]


def test_zero3_under_bf16_compute_sums_gradients_in_fp32_like_zero0():
    """Under bf16 mixed precision ZeRO-3's gather gets the fp32 masters' shards and casts them itself, so
    its backward reduce-scatters in fp32 and the masters receive fp32 sums: on 2 ranks the first step's
    gradients are ZeRO-0's bit for bit (a bf16 reduce-scatter rounded them to bf16: 2.4e-4 off on wte)."""
    x, y = make_batch("tokens", 8, vocab=64, seq=8)
    torch.manual_seed(0)
    plan = autopar.plan(GPT_SMALL(), autopar.Mesh(2), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                        mode="data", mixed_precision="bf16")
    g0, g3 = (run_ranks(2, _bf16_grads_job, _with_zero(plan, z).to_json())[0] for z in (0, 3))
    assert sorted(g0) == sorted(g3)
    assert all(g3[k].dtype == torch.float32 for k in g3)
    assert [k for k in g0 if not torch.equal(g0[k], g3[k])] == []
