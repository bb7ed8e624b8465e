"""The CUDA / NCCL path: one rank on one GPU (NCCL refuses two ranks on one device), ``pytest -m gpu``.

Skipped without CUDA, so the CPU suite only collects these. Each case runs in a spawned rank whose default
group ``runtime/launch.init_rank`` makes with NCCL when CUDA is there, and compares with a run made in the
test on the same GPU (TF32 off on both sides): fp32 DATA / AUTO / compiled at the oracle's 1e-5; bf16 and
fp16 (loss scaling) against the same precision recipe by hand; a model built on meta whose pieces land on
``cuda:LOCAL_RANK``, filled by ``init_weights`` equal to the CPU build; a checkpoint saved and loaded on the GPU.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch
from torch.func import functional_call

import autopar
from conftest import run_ranks
from examples.models import GPT, lm_loss
from oracle import LR, _train, assert_same_training, distance, make_optimizer

DEV = os.environ.get("AUTOPAR_GPU_TESTS_ON", "cuda")    # "cpu": a dry run of these cases on gloo
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(),
                                                  reason="needs a CUDA device")]
WANT = ("cuda:0", "nccl") if DEV == "cuda" else ("cpu", "gloo")

MODEL = functools.partial(GPT, vocab=128, hidden=64, heads=4, layers=2, seq=16, dropout=0.0)
STEPS = 3
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
SCALING = {"init_scale": 2.0 ** 30, "growth_factor": 2.0 ** 16, "backoff_factor": 2.0 ** -16, "growth_interval": 2}


def _exact_matmuls() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _data(dev: str = DEV):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(1, 128, (8, 16), generator=g)
    return x.to(dev), torch.randint(0, 128, (8, 16), generator=g).to(dev)


def _cuda_model():
    return MODEL().to(DEV)


def _reference(precision: str | None = None):
    """One GPU, plain torch: SGD with momentum; ``precision`` computes on bf16/fp16 working copies of
    the fp32 masters (autopar's recipe, tests/ranks/test_mixed_precision.py and test_fp16.py): fp16 with
    its logits cast to fp32 for the loss and torch.amp.GradScaler."""
    _exact_matmuls()
    x, y = _data()
    torch.manual_seed(0)
    model = _cuda_model()
    opt = make_optimizer(model.parameters(), "sgd", LR["sgd"])
    names = {id(p): n for n, p in model.named_parameters()}
    scaler = torch.amp.GradScaler(DEV, **SCALING) if precision == "fp16" else None
    out = {"skipped": []}

    def step(_m):
        params = dict(model.named_parameters())
        if precision is not None:
            params = {k: v.to(LOW[precision]) for k, v in params.items()}
        logits = functional_call(model, params, (x,))
        loss = lm_loss(logits.float() if precision == "fp16" else logits, y)   # bf16: the loss in bf16 too
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        return loss.detach()

    class Opt:
        def step(self):
            if scaler:
                before = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                out["skipped"].append(scaler.get_scale() < before)
            else:
                opt.step()

        def zero_grad(self):
            opt.zero_grad()

    run = _train(step, lambda: {k: v.detach() for k, v in model.state_dict().items()},
                 lambda: {names[id(p)]: p.grad for p in model.parameters() if p.grad is not None}, Opt(), STEPS)
    return run | out


def _clone(state: dict) -> dict:
    return {k: v.detach().clone() for k, v in state.items()}


def _job(rank, mode, precision, compile_):
    _exact_matmuls()
    x, y = _data()
    kw = {"mixed_precision": precision} if precision else {}
    if precision == "fp16":
        autopar.set_auto_parallel_context(loss_scaling=SCALING)
    torch.manual_seed(0)
    pm = autopar.parallelize(_cuda_model(), autopar.Mesh(1), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                             mode=mode, compile=compile_, **kw)
    opt = make_optimizer(pm.parameters(), "sgd", LR["sgd"])
    out = {"losses": [], "grads": [], "params": [], "skipped": [], "optim": "sgd",
           "device": str(next(iter(pm.parameters())).device), "backend": torch.distributed.get_backend()}
    for _ in range(STEPS):
        out["losses"].append(float(pm.step(x, target=y)))
        out["grads"].append(_clone(pm.full_grad_dict()))
        if precision == "fp16":
            out["skipped"].append(bool(pm.scaler.found_inf))
        opt.step()
        opt.zero_grad()
        out["params"].append(_clone(pm.full_state_dict()))
    return out


def _gap(run, ref) -> float:
    """``oracle.distance`` leaving out the gradients of steps the loss scaling skipped (they hold infs)."""
    keep = [i for i in range(len(ref["grads"])) if not (ref["skipped"] and ref["skipped"][i])]
    pick = lambda r: r | {"grads": [r["grads"][i] for i in keep]}  # noqa: E731
    return distance(pick(run), pick(ref))


@pytest.mark.parametrize("mode,compile_", [("data", False), ("auto", False), ("stand_alone", True)])
def test_fp32_on_one_gpu_trains_like_torch(mode, compile_):
    ref = _reference()
    (got,) = run_ranks(1, _job, mode, None, compile_)
    assert (got["device"], got["backend"]) == WANT
    assert_same_training(ref, got, what=f"{mode} compile={compile_} on CUDA")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_on_one_gpu_lands_where_the_recipe_by_hand_does(precision):
    """bf16 / fp16 working copies on the GPU: the CUDA path of the recipe (casts on the device, the found-inf
    flag all-reduced over NCCL; fp16 starts at a loss scale of 2^30, so its first step overflows and must be
    skipped as GradScaler skips it). One device runs the whole ops, so autopar's run is the recipe by hand's
    up to kernel choice: within 1e-3 of the distance low precision itself puts between the fp32 run and the
    recipe (0 on the CPU)."""
    ref, fp32 = _reference(precision), _reference()
    (got,) = run_ranks(1, _job, "data", precision, False)
    if precision == "fp16":
        assert got["skipped"] == ref["skipped"] and ref["skipped"][0], (got["skipped"], ref["skipped"])
    d, rounding = _gap(got, ref), _gap(fp32 | {"skipped": ref["skipped"]}, ref)
    assert d <= 1e-3 * rounding, f"{precision}: autopar {d:.3e} from the recipe by hand; fp32 is {rounding:.3e} away"


def _meta_job(rank, path):
    _exact_matmuls()
    x, y = _data()
    with torch.device("meta"):
        model = MODEL()
    pm = autopar.parallelize(model, autopar.Mesh(1), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                             mode="data")
    pm.init_weights(seed=0)
    init = {k: v.cpu() for k, v in pm.full_state_dict().items()}
    devices = {str(p.device) for p in pm.parameters()}
    opt = make_optimizer(pm.parameters(), "sgd", LR["sgd"])
    losses = []
    for i in range(4):
        if i == 2:
            pm.save(path, optimizer=opt)
        losses.append(float(pm.step(x, target=y)))
        opt.step()
        opt.zero_grad()
    with torch.device("meta"):
        again = MODEL()
    pm2 = autopar.parallelize(again, autopar.Mesh(1), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                              plan=pm.plan)
    opt2 = make_optimizer(pm2.parameters(), "sgd", LR["sgd"])
    pm2.load(path, optimizer=opt2)
    resumed = []
    for _ in range(2):
        resumed.append(float(pm2.step(x, target=y)))
        opt2.step()
        opt2.zero_grad()
    return init, devices, losses, resumed


def test_meta_model_lands_on_the_gpu_inits_like_the_cpu_build_and_resumes_from_a_checkpoint(tmp_path):
    torch.manual_seed(0)
    want = MODEL().state_dict()
    (init, devices, losses, resumed), = run_ranks(1, _meta_job, str(tmp_path / "ckpt"))
    assert devices == {WANT[0]}
    for k, v in want.items():
        assert torch.equal(init[k], v), f"{k}: init_weights on CUDA differs from the CPU build"
    ref = _reference()
    for a, b in zip(losses, ref["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), f"loss {a} != {b}"
    for a, b in zip(resumed, losses[2:]):
        assert abs(a - b) <= 1e-6 * abs(b), f"resumed losses {resumed} != uninterrupted {losses[2:]}"
