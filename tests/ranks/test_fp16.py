"""mixed_precision="fp16": fp16 compute on working copies of fp32 masters, the loss in fp32, dynamic
loss scaling (torch.amp.GradScaler's recipe, ``runtime/loss_scale.py``) in the standard loop.

The oracle (docs/testing.md, as test_mixed_precision.py for bf16): the single-device run under the
same recipe (``_reference``: fp16 working copies, outputs cast to fp32 for the loss, torch's own
``torch.amp.GradScaler``). fp16 keeps 11 significant bits, and a data-parallel or tensor-parallel
sum rounds differently from the whole op, so the bound is measured: torch's FSDP2 (same policy,
the same loss scaling) lands ``d_torch`` from the single-device run; every plan must land within
``TORCH_FACTOR`` x that. The job forces overflows: the scale starts at 2^30 (the fp16 gradient
of the logits overflows), backs off to 2^14, grows back to 2^30 after two clean steps and overflows
again, so the skipped steps (parameters and momentum untouched) and the scale sequence must equal
GradScaler's exactly (DATA, TP, PP, ZeRO-2, ZeRO-3). A last step puts an inf in one rank's gradient only:
every rank must skip.
"""
from __future__ import annotations

import functools

import pytest
import torch
from torch.func import functional_call

import autopar
from autopar import Shard
from conftest import run_ranks
from examples.models import GPT, lm_loss
from oracle import distance, make_optimizer

FP16 = torch.float16
TORCH_FACTOR = 2.0
STEPS, BATCH, LR = 6, 8, 0.05
SCALING = {"init_scale": 2.0 ** 30, "growth_factor": 2.0 ** 16, "backoff_factor": 2.0 ** -16, "growth_interval": 2}
SKIPS = [True, False, False, True, False, False]      # what GradScaler does with SCALING on this job
MODEL = functools.partial(GPT, layers=2, hidden=32, dropout=0.0)


def _data():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 128, (BATCH, 16), generator=g)
    return x, torch.randint(0, 128, (BATCH, 16), generator=g)


def _loop(step, unscaled_grads, apply, scale_of, params_fn):
    """``STEPS`` steps: losses, the unscaled gradients of the steps that did not overflow, the
    parameters after every step, the scale each step used and whether its optimizer step was skipped."""
    out = {"losses": [], "grads": [], "params": [], "scales": [], "skipped": []}
    for _ in range(STEPS):
        out["scales"].append(scale_of())
        out["losses"].append(float(step()))
        grads, skipped = unscaled_grads()
        out["skipped"].append(skipped)
        if not skipped:
            out["grads"].append({k: v.detach().clone() for k, v in grads.items()})
        apply()
        out["params"].append({k: v.detach().clone() for k, v in params_fn().items()})
    return out


def _compare(run, ref) -> float:
    """``distance`` over the losses, the clean steps' gradients and every step's parameters."""
    return distance(run, ref)


def _reference(x, y):
    """One device: fp16 working copies of the fp32 masters, fp32 loss, torch.amp.GradScaler."""
    torch.manual_seed(0)
    model = MODEL()
    opt = make_optimizer(model.parameters(), "sgd", LR)
    scaler = torch.amp.GradScaler("cpu", **SCALING)
    names = {id(p): n for n, p in model.named_parameters()}

    def step():
        working = {k: v.to(FP16) for k, v in model.named_parameters()}
        loss = lm_loss(functional_call(model, working, (x,)).float(), y)
        scaler.scale(loss).backward()
        return loss.detach()

    def grads():
        scaler.unscale_(opt)
        grads = {names[id(p)]: p.grad for p in model.parameters() if p.grad is not None}
        return grads, any(not torch.isfinite(g).all() for g in grads.values())

    def apply():
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    return _loop(step, grads, apply, scaler.get_scale, lambda: model.state_dict())


def _fsdp_job(rank):
    """torch's own: FSDP2 over 2 ranks, fp16 params, fp32 reduce and outputs, the same loss scaling
    (the inf/nan flag all-reduced over both ranks, as its shards differ)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    x, y = _data()
    torch.manual_seed(0)
    model = MODEL()
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)),
                mp_policy=MixedPrecisionPolicy(param_dtype=FP16, reduce_dtype=torch.float32,
                                               output_dtype=torch.float32))
    opt = make_optimizer(model.parameters(), "sgd", LR)
    xl, yl = x.chunk(2)[rank], y.chunk(2)[rank]
    state = {"scale": SCALING["init_scale"], "clean": 0}

    def full(tensors):
        return {k: v.full_tensor().detach() if hasattr(v, "full_tensor") else v.detach() for k, v in tensors.items()}

    def step():
        loss = lm_loss(model(xl), yl)
        (loss * state["scale"]).backward()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        return total / 2

    def grads():
        local = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
        flag = torch.tensor(float(any(not torch.isfinite(g).all() for g in local)))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        for g in local:
            g.mul_(1.0 / state["scale"])
        state["inf"] = bool(flag > 0)
        return full({n: p.grad for n, p in model.named_parameters() if p.grad is not None}), state["inf"]

    def apply():
        if state["inf"]:
            state["scale"] *= SCALING["backoff_factor"]
            state["clean"] = 0
        else:
            opt.step()
            state["clean"] += 1
            if state["clean"] == SCALING["growth_interval"]:
                state["scale"] *= SCALING["growth_factor"]
                state["clean"] = 0
        opt.zero_grad()

    return _loop(step, grads, apply, lambda: state["scale"], lambda: full(model.state_dict()))


def _tp(model):
    autopar.shard("blocks.*.fc1", weight={"tp": Shard(0)})
    autopar.shard("blocks.*.fc2", weight={"tp": Shard(1)})


PLANS = {   # name: (mesh shape, axis names, mode, annotate, context)
    "data": ((2,), None, "data", None, {}),
    "tp": ((2,), ("tp",), "semi_auto", _tp, {}),
    "pp": ((2,), ("pp",), "auto", None, {}),
    "zero2": ((2,), None, "data", None, {"zero": 2}),
    "zero3": ((2,), None, "data", None, {"zero": 3}),
}



def _compute_dtypes(pmodel) -> set[str]:
    """The dtypes the last step computed the parameters in: the working copies, and ZeRO-3's gathers
    (which cast the masters' shards themselves)."""
    from autopar.runtime.zero3 import Zero3Gather

    gathers = {str(m.dtype) for m in pmodel.program.modules() if isinstance(m, Zero3Gather)}
    return {str(t.dtype) for t in pmodel.program._working.values()} | gathers

def _job(rank, name):
    shape, names, mode, annotate, context = PLANS[name]
    x, y = _data()
    autopar.set_auto_parallel_context(loss_scaling=SCALING, **context)
    torch.manual_seed(0)
    model = MODEL()
    if annotate is not None:
        annotate(model)
    pmodel = autopar.parallelize(model, autopar.Mesh(shape, axis_names=names, device="v100-16gb"),
                                 example_inputs=(x,), loss_fn=lm_loss, example_target=y, mode=mode,
                                 mixed_precision="fp16")
    opt = make_optimizer(pmodel.parameters(), "sgd", LR)

    def grads():
        g = pmodel.full_grad_dict()
        return g, pmodel.scaler.found_inf

    def apply():
        opt.step()
        opt.zero_grad()

    out = _loop(lambda: pmodel.step(x, target=y), grads, apply, lambda: pmodel.loss_scale,
                pmodel.full_state_dict)
    out["plan"] = pmodel.plan.to_json()
    out["working"] = _compute_dtypes(pmodel)
    out.update(_one_rank_overflows(rank, pmodel, opt, x, y))
    return out


def _one_rank_overflows(rank, pmodel, opt, x, y) -> dict:
    """One more step, at a scale that does not overflow, with an inf put into the last rank's gradient
    only after the backward."""
    before = {k: v.clone() for k, v in pmodel.full_state_dict().items()}
    pmodel.scaler.scale = scale = 2.0 ** 14
    pmodel.step(x, target=y)
    pmodel._flush_grads()
    pieces = pmodel._grad_pieces()
    if rank == torch.distributed.get_world_size() - 1:
        pieces[0][0].view(-1)[0] = float("inf")
    opt.step()
    opt.zero_grad()
    after = pmodel.full_state_dict()
    return {"lone_skip": all(torch.equal(before[k], after[k]) for k in before),
            "lone_scale": (scale, pmodel.loss_scale)}


@pytest.fixture(scope="module")
def references():
    x, y = _data()
    return {"fp16": _reference(x, y), "fsdp": run_ranks(2, _fsdp_job)[0]}


def test_the_job_overflows_where_intended(references):
    ref = references["fp16"]
    assert ref["skipped"] == SKIPS
    assert ref["scales"] == [2.0 ** 30, 2.0 ** 14, 2.0 ** 14, 2.0 ** 30, 2.0 ** 14, 2.0 ** 14]
    assert references["fsdp"]["skipped"] == SKIPS and references["fsdp"]["scales"] == ref["scales"]
    torch_d = _compare(references["fsdp"], ref)
    assert 0 < torch_d < 2e-2, f"torch FSDP2 lands {torch_d:.3e} from the fp16 reference: the reference is off"


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("tp", "zero3") else n for n in PLANS])
def test_fp16_trains_and_skips_like_one_device_with_grad_scaler(name, references):
    ref = references["fp16"]
    results = run_ranks(2, _job, name)
    plan = autopar.Plan.from_json(results[0]["plan"])
    assert plan.memory_options.mixed_precision == "fp16"
    if name in ("tp", "pp"):
        assert plan.degrees[name] == 2, plan.degrees
    if name.startswith("zero"):
        assert plan.memory_options.zero == int(name[-1])
    torch_d = _compare(references["fsdp"], ref)
    for rank, r in enumerate(results):
        assert r["working"] == {"torch.float16"}, f"{name}: rank {rank} computed with {r['working']}"
        assert r["skipped"] == ref["skipped"], f"{name} rank {rank}: skipped {r['skipped']} != {ref['skipped']}"
        assert r["scales"] == ref["scales"], f"{name} rank {rank}: scales {r['scales']} != {ref['scales']}"
        for i, skipped in enumerate(r["skipped"]):
            if skipped and i > 0:
                assert all(torch.equal(r["params"][i][k], r["params"][i - 1][k]) for k in r["params"][i]), \
                    f"{name} rank {rank}: the skipped step {i + 1} changed the parameters"
        d = _compare(r, ref)
        assert d <= TORCH_FACTOR * torch_d, (f"{name} rank {rank}: {d:.3e} from the single-device GradScaler run; "
                                             f"torch FSDP2 lands {torch_d:.3e}")
        assert r["lone_skip"], f"{name} rank {rank}: an inf on one rank did not skip the step here"
        assert r["lone_scale"] == (2.0 ** 14, 2.0 ** -2), r["lone_scale"]



def _stand_alone(**kw):
    x, y = _data()
    torch.manual_seed(0)
    return autopar.parallelize(MODEL(), autopar.Mesh(1, device="v100-16gb"), example_inputs=(x,), loss_fn=lm_loss,
                               example_target=y, mode="stand_alone", mixed_precision="fp16", **kw), x, y


def test_masters_state_and_loss_stay_fp32_and_clip_sees_unscaled_gradients():
    """One process: the standard loop with clip_grad_norm_ against GradScaler's documented recipe
    (scale, backward, unscale_, clip, step, update), step by step."""
    pmodel, x, y = _stand_alone()
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    torch.manual_seed(0)
    model = MODEL()
    ropt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(2):
        assert pmodel.loss_scale == scaler.get_scale() == 2.0 ** 16
        loss = pmodel.step(x, target=y)
        norm = pmodel.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
        working = {k: v.to(FP16) for k, v in model.named_parameters()}
        ref_loss = lm_loss(functional_call(model, working, (x,)).float(), y)
        scaler.scale(ref_loss).backward()
        scaler.unscale_(ropt)
        ref_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(ropt)
        scaler.update()
        ropt.zero_grad()
        assert loss.dtype == torch.float32
        assert float(loss) == pytest.approx(float(ref_loss.detach()), rel=1e-3)
        assert float(norm) == pytest.approx(float(ref_norm), rel=1e-2), "clip saw scaled gradients"
    assert all(p.dtype == torch.float32 for p in pmodel.parameters())
    assert all(v.dtype == torch.float32 for s in opt.state.values() for v in s.values() if v.is_floating_point())
    assert "fp16" in pmodel.plan.report()
    assert pmodel.scaler.state_dict() == {"scale": 2.0 ** 16, "growth_tracker": 2, "skipped_steps": 0}


def test_the_loss_scale_is_saved_and_restored(tmp_path):
    pmodel, x, y = _stand_alone()
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.01)
    pmodel.step(x, target=y)
    opt.step()
    pmodel.scaler.scale, pmodel.scaler.growth_tracker = 2.0 ** 9, 5
    pmodel.save(tmp_path / "ckpt", opt)
    fresh, _, _ = _stand_alone()
    assert fresh.loss_scale == 2.0 ** 16
    fresh.load(tmp_path / "ckpt", torch.optim.SGD(fresh.parameters(), lr=0.01))
    assert fresh.scaler.state_dict() == {"scale": 2.0 ** 9, "growth_tracker": 5, "skipped_steps": 0}


def test_only_fp16_has_a_scaler():
    x, y = _data()
    pmodel = autopar.parallelize(MODEL(), autopar.Mesh(1), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                                 mode="stand_alone", mixed_precision="bf16")
    assert pmodel.scaler is None and pmodel.loss_scale is None


def test_fp16_is_costed_at_the_fp16_peak():
    """V100: fp32 15.7 TFLOP/s, fp16 tensor cores 125, no bf16 ones; the matmuls dominate this job."""
    from examples.factories import gpt

    def plan(mp):
        model, inputs, loss, target = gpt(hidden=512, layers=2, heads=8, seq=256, batch=8)
        return autopar.plan(model, autopar.Mesh(1, device="v100-16gb"), example_inputs=inputs, loss_fn=loss,
                            example_target=target, mode="stand_alone", mixed_precision=mp)

    fp32, fp16, bf16 = plan(None), plan("fp16"), plan("bf16")
    assert fp16.memory_options.mixed_precision == "fp16"
    assert fp16.step_time < 0.5 * fp32.step_time, (fp16.step_time, fp32.step_time)
    assert fp16.step_time < 0.5 * bf16.step_time, (fp16.step_time, bf16.step_time)
    state = lambda p: p.memory_breakdown["params+grads+optimizer"]   # noqa: E731
    assert state(fp16) == pytest.approx(state(bf16))
    # bf16's 2-byte activations, where the loss saves the fp32 copy of the logits it reads instead of
    # the 2-byte logits (the cast saves nothing for its backward)
    logits_fp32, logits_half = 8 * 256 * 51200 * 4, 8 * 256 * 51200 * 2
    act = lambda p: p.memory_breakdown["activations"]   # noqa: E731
    assert act(fp16) == pytest.approx(act(bf16) + logits_fp32 - logits_half, rel=0.01), (act(fp16), act(bf16))


@pytest.mark.parametrize("value, message", [
    ({"init_scale": 0}, r"loss_scaling\['init_scale'\] = 0 is out of range"),
    ({"backoff_factor": 1.5}, r"loss_scaling\['backoff_factor'\] = 1.5 is out of range"),
    ({"growth_factor": "2"}, r"loss_scaling\['growth_factor'\] = '2' is out of range"),
    ({"growth_interval": 0}, r"loss_scaling\['growth_interval'\] = 0 must be an int >= 1"),
    ({"init": 2.0}, r"loss_scaling must be None or a dict with keys from \['init_scale'"),
    (65536.0, r"loss_scaling must be None or a dict"),
])
def test_bad_loss_scaling_is_refused(value, message):
    with pytest.raises(ValueError, match=message):
        autopar.set_auto_parallel_context(loss_scaling=value)


def test_bad_mixed_precision_names_the_choices():
    x, y = _data()
    with pytest.raises(ValueError, match="mixed_precision must be None, 'bf16' or 'fp16', got 'fp8'"):
        autopar.plan(MODEL(), autopar.Mesh(1), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                     mixed_precision="fp8")
    with pytest.raises(ValueError, match="mixed_precision must be None, 'bf16' or 'fp16', got 'half'"):
        autopar.set_auto_parallel_context(mixed_precision="half")
