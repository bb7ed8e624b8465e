"""The oracle: a parallel run trains exactly like single-device training.

``reference_run`` trains a fresh model on one process; ``parallel_run`` (called on every
rank) trains the same model through autopar. Both return the losses, the gradients gathered
before every optimizer step and the parameters after it, so tests compare them at 1e-5 relative.
The optimizer is SGD with momentum unless a test asks for AdamW: AdamW's update does not change
when every gradient is scaled by a constant, so a gradient-scale error would pass an AdamW-only
comparison of parameters.
"""
from __future__ import annotations

import torch

import autopar

STEPS = 3
LR = {"sgd": 0.05, "adamw": 1e-3}


def make_batch(kind: str, batch: int, seed: int = 1, **kw):
    g = torch.Generator().manual_seed(seed)
    if kind == "tokens":
        vocab, seq = kw.get("vocab", 128), kw.get("seq", 16)
        x = torch.randint(1, vocab, (batch, seq), generator=g)
        y = torch.randint(0, vocab, (batch, seq), generator=g)
        return x, y
    if kind == "classify_tokens":
        vocab, seq, classes = kw.get("vocab", 128), kw.get("seq", 16), kw.get("classes", 4)
        x = torch.randint(1, vocab, (batch, seq), generator=g)
        x[:, -3:] = 0  # padding
        return x, torch.randint(0, classes, (batch,), generator=g)
    if kind == "image":
        return torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, 10, (batch,), generator=g)
    if kind == "vector":
        return torch.randn(batch, kw.get("d_in", 32), generator=g), torch.randint(0, 10, (batch,), generator=g)
    raise ValueError(kind)


def make_optimizer(params, optim: str, lr: float, eps: float = 1e-8):
    """``"sgd"`` (SGD with momentum 0.9, the default: its update is linear in the gradient, so a
    gradient-scale error shows in the parameters) or ``"adamw"`` (scale-invariant update)."""
    params = [p for p in params if p.requires_grad]
    if optim == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if optim == "adamw":
        return torch.optim.AdamW(params, lr=lr, eps=eps)
    raise ValueError(optim)


def _train(step_fn, params_fn, grads_fn, opt, steps, micro: int = 1, clip_fn=None):
    """``micro`` > 1: each step accumulates ``micro`` backward passes before the optimizer step;
    ``clip_fn``: clips the gradients (returns the norm before clipping) before they are compared."""
    losses, grads, params, norms = [], [], [], []
    for _ in range(steps):
        for m in range(micro):
            loss = step_fn(m)
            losses.append(float(loss))
        if clip_fn is not None:
            norms.append(float(clip_fn()))
        grads.append({k: v.clone() for k, v in grads_fn().items()})
        opt.step()
        opt.zero_grad()
        params.append({k: v.clone() for k, v in params_fn().items()})
    return {"losses": losses, "grads": grads, "params": params, "norms": norms}


def _chunks(t, micro):
    return t.chunk(micro, 0) if micro > 1 else (t,)


def reference_run(model_fn, loss_fn, x, y, steps: int = STEPS, lr: float | None = None, eps: float = 1e-8,
                  optim: str = "sgd", micro: int = 1, setup=None, clip: float | None = None,
                  mixed_precision: str | None = None, accumulate: int = 1):
    """Single-device training: ``loss.backward()`` per micro-batch, then the optimizer's step.
    ``mixed_precision="bf16"``: the same policy as autopar's (and FSDP2's): every step computes on
    bf16 copies of the fp32 parameters, floating inputs cast to bf16, the loss reported in fp32.
    ``accumulate``: each micro-batch runs as that many backward passes of ``loss / accumulate`` (torch's
    own gradient accumulation, the job a plan's accumulation runs), its loss the mean of theirs."""
    torch.manual_seed(0)
    model = model_fn()
    if setup is not None:
        setup(model)
    opt = make_optimizer(model.parameters(), optim, lr if lr is not None else LR[optim], eps)
    xs, ys = _chunks(x, micro), _chunks(y, micro)
    low = {"bf16": torch.bfloat16}[mixed_precision] if mixed_precision else None

    def forward(xb):
        if low is None:
            return model(xb)
        working = {k: v.to(low) if v.is_floating_point() else v for k, v in model.named_parameters()}
        return torch.func.functional_call(model, working, (xb.to(low) if xb.is_floating_point() else xb,))

    def step(m):
        total = torch.zeros(())
        for xa, ya in zip(_chunks(xs[m], accumulate), _chunks(ys[m], accumulate)):
            loss = loss_fn(forward(xa), ya)
            (loss / accumulate if accumulate > 1 else loss).backward()
            total += loss.detach().float()
        return total / accumulate

    names = {id(p): n for n, p in model.named_parameters()}
    clip_fn = None if clip is None else lambda: torch.nn.utils.clip_grad_norm_(
        [p for p in model.parameters() if p.grad is not None], clip)
    return _train(step, lambda: {k: v.detach() for k, v in model.state_dict().items()},
                  lambda: {names[id(p)]: p.grad for p in model.parameters() if p.grad is not None}, opt, steps, micro,
                  clip_fn)


def adamw_steps(pm, x, y, steps: int = 3, lr: float = 1e-2) -> tuple[list[float], dict]:
    """(losses, gathered state) after ``steps`` AdamW steps of ``pm`` on one batch."""
    opt = torch.optim.AdamW(pm.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        losses.append(float(pm.step(x, target=y)))
        opt.step()
        opt.zero_grad()
    return losses, pm.full_state_dict()


def parallel_run(rank, model_fn, loss_fn, x, y, mesh, mode, steps: int = STEPS, lr: float | None = None,
                 eps: float = 1e-8, setup=None, optim: str = "sgd", micro: int = 1, clip: float | None = None,
                 inspect=None, **kw):
    """The same training through autopar on every rank (planned for one micro-batch's shape);
    ``inspect(pmodel)``, called after training, adds what it returns as ``out["inspect"]``."""
    torch.manual_seed(0)
    model = model_fn()
    if setup is not None:
        setup(model)
    xs, ys = _chunks(x, micro), _chunks(y, micro)
    pmodel = autopar.parallelize(model, mesh, example_inputs=(xs[0],), loss_fn=loss_fn, example_target=ys[0],
                                 mode=mode, **kw)
    opt = make_optimizer(pmodel.parameters(), optim, lr if lr is not None else LR[optim], eps)
    clip_fn = None if clip is None else lambda: pmodel.clip_grad_norm_(clip)
    out = _train(lambda m: pmodel.step(xs[m], target=ys[m]), pmodel.full_state_dict, pmodel.full_grad_dict, opt,
                 steps, micro, clip_fn)
    out["degrees"] = pmodel.plan.degrees
    if inspect is not None:
        out["inspect"] = inspect(pmodel)
    out["plan"] = pmodel.plan.to_json()
    out["optim"] = optim
    return out


PARAM_TENSOR_RTOL = 1e-3


def assert_same_training(ref, par, rtol: float = 1e-5, what: str = "", tensor_rtol: float | None = None):
    """The oracle, at ``rtol`` relative:

    * every loss;
    * every gathered gradient before every optimizer step, tensor by tensor;
    * the parameters (and buffers) after every step: tensor by tensor under SGD; under AdamW as
      one vector over the whole model and tensor by tensor to PARAM_TENSOR_RTOL (a zero-initialised
      bias after one AdamW step is ±lr per element, so an element whose true gradient is ~0 moves
      by float noise in BOTH runs and a per-tensor 1e-5 would compare noise, docs/testing.md).
      ``tensor_rtol`` overrides the per-tensor bound of the gradients and the parameters (a model
      with attention key biases, whose true gradient is exactly 0, compares those as part of the
      whole model's gradient and parameter vectors, each at ``rtol``).
    """
    assert len(par["losses"]) == len(ref["losses"])
    for a, b in zip(par["losses"], ref["losses"]):
        assert abs(a - b) <= rtol * max(abs(b), 1e-6), f"{what} loss {a} != {b}"
    for a, b in zip(par.get("norms", []), ref.get("norms", [])):
        assert abs(a - b) <= rtol * max(abs(b), 1e-6), f"{what} gradient norm {a} != {b}"
    for i, (ga, gb) in enumerate(zip(par["grads"], ref["grads"])):
        _close(ga, gb, rtol if tensor_rtol is None else tensor_rtol, f"{what} grad before step {i + 1}")
        if tensor_rtol is not None:
            keys = [k for k, v in gb.items() if v.is_floating_point()]
            err = rel_error(torch.cat([ga[k].double().flatten() for k in keys]),
                            torch.cat([gb[k].double().flatten() for k in keys]))
            assert err <= rtol, f"{what} grad before step {i + 1}: whole-model relative error {err:.3e} > {rtol:.0e}"
    adamw = par.get("optim") == "adamw"
    for i, (pa, pb) in enumerate(zip(par["params"], ref["params"])):
        per_tensor = tensor_rtol if tensor_rtol is not None else PARAM_TENSOR_RTOL if adamw else rtol
        _close(pa, pb, per_tensor, f"{what} params after step {i + 1}")
        keys = [k for k, v in pb.items() if v.is_floating_point()]
        got = torch.cat([pa[k].double().flatten() for k in keys])
        want = torch.cat([pb[k].double().flatten() for k in keys])
        err = rel_error(got, want)
        assert err <= rtol, f"{what} params after step {i + 1}: whole-model relative error {err:.3e} > {rtol:.0e}"


TORCH_NOISE_FACTOR = 2.0


def assert_within_torch_noise(ref, par, torch_runs: list, what: str = "", factor: float = TORCH_NOISE_FACTOR,
                              floor: float = 1e-5):
    """The bar where reordered sums move the result past 1e-5 (docs/testing.md): ``par`` no further from
    ``ref`` than ``factor`` x where torch's own runs of the same job (``torch_runs``: one device, DDP,
    one device accumulating as the plan does) land, the furthest of them, or ``floor``; ``ref`` is the
    single-device run, or the exact one (float64) when ``torch_runs`` holds the fp32 single-device
    run. Checked: every loss; at every step the worst gradient tensor and the whole gradient; the worst
    parameter tensor and the whole model after every step."""
    def check(what_, ours: float, theirs: list[float]):
        assert ours <= max(factor * max(theirs), floor), (f"{what} {what_}: {ours:.3e} from the reference, torch's "
                                                          f"furthest {max(theirs):.3e}")

    for i, b in enumerate(ref["losses"]):
        rel = [abs(r["losses"][i] - b) / max(abs(b), 1e-6) for r in torch_runs]
        check(f"loss {i}", abs(par["losses"][i] - b) / max(abs(b), 1e-6), rel)
    for key in ("grads", "params"):
        for i, want in enumerate(ref[key]):
            keys = sorted(k for k, w in want.items() if w.is_floating_point())
            for name, measure in (("worst tensor", lambda s: max(rel_error(s[k], want[k]) for k in keys)),
                                  ("whole model", lambda s: rel_error(torch.cat([s[k].flatten() for k in keys]),
                                                                      torch.cat([want[k].flatten() for k in keys])))):
                check(f"{key} at step {i + 1}, {name}", measure(par[key][i]), [measure(r[key][i]) for r in torch_runs])


def distance(run, ref) -> float:
    """The largest relative difference of ``run`` from ``ref`` over the losses, and over the whole
    model's gradient and parameters as one vector each, at every step: the measure for mixed
    precision, where a tensor whose gradient is ~0 is all rounding (docs/testing.md)."""
    d = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(run["losses"], ref["losses"]))
    for key in ("grads", "params"):
        for got, want in zip(run[key], ref[key]):
            keys = sorted(k for k, w in want.items() if w.is_floating_point())
            d = max(d, rel_error(torch.cat([got[k].flatten() for k in keys]),
                                 torch.cat([want[k].flatten() for k in keys])))
    return d


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Per-tensor relative error ||got - want|| / ||want||.

    Norm-wise, not element-wise: AdamW divides each gradient element by its own magnitude,
    so an element whose true gradient is ~0 moves by float noise in BOTH runs; those few
    elements must not decide the comparison (docs/testing.md).
    """
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-12)).item()


def _close(got: dict, want: dict, rtol: float, what: str):
    missing = set(want) - set(got)
    assert not missing, f"{what}: missing {sorted(missing)[:5]}"
    for k, w in want.items():
        g = got[k]
        assert g.shape == w.shape, f"{what} {k}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        if not w.is_floating_point():
            assert torch.equal(g, w), f"{what} {k} differs"
            continue
        err = rel_error(g, w)
        assert err <= rtol, f"{what} {k}: relative error {err:.3e} > {rtol:.0e}"
