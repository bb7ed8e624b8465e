"""The oracle: a parallel run trains exactly like single-device training.

``reference_run`` trains a fresh model on one process; ``parallel_run`` (called on every
rank) trains the same model through autopar. Both return losses, the gradients of the first
step and the parameters after every optimizer step (AdamW unless ``optimizer`` builds another
from the parameters), so tests compare them at 1e-5 relative.
"""
from __future__ import annotations

import torch

import autopar

STEPS = 3
LR = 1e-3


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


def _train(step_fn, params_fn, grads_fn, opt, steps):
    losses, grads, params = [], None, []
    for i in range(steps):
        loss = step_fn()
        losses.append(float(loss))
        if i == 0:
            grads = {k: v.clone() for k, v in grads_fn().items()}
        opt.step()
        opt.zero_grad()
        params.append({k: v.clone() for k, v in params_fn().items()})
    return {"losses": losses, "grads": grads, "params": params}


def _optimizer(params, optimizer, lr: float, eps: float) -> torch.optim.Optimizer:
    return optimizer(params) if optimizer is not None else torch.optim.AdamW(params, lr=lr, eps=eps)


def reference_run(model_fn, loss_fn, x, y, steps: int = STEPS, lr: float = LR, eps: float = 1e-8, optimizer=None):
    torch.manual_seed(0)
    model = model_fn()
    opt = _optimizer(model.parameters(), optimizer, lr, eps)

    def step():
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss.detach()

    names = {id(p): n for n, p in model.named_parameters()}
    return _train(step, lambda: {k: v.detach() for k, v in model.state_dict().items()},
                  lambda: {names[id(p)]: p.grad for p in model.parameters() if p.grad is not None}, opt, steps)


def parallel_run(rank, model_fn, loss_fn, x, y, mesh, mode, steps: int = STEPS, lr: float = LR, eps: float = 1e-8, setup=None,
                 optimizer=None, **kw):
    torch.manual_seed(0)
    model = model_fn()
    if setup is not None:
        setup(model)
    pmodel = autopar.parallelize(model, mesh, example_inputs=(x,), loss_fn=loss_fn, example_target=y, mode=mode, **kw)
    opt = _optimizer(pmodel.parameters(), optimizer, lr, eps)
    out = _train(lambda: pmodel.step(x, target=y), pmodel.full_state_dict, pmodel.full_grad_dict, opt, steps)
    out["degrees"] = pmodel.plan.degrees
    out["plan"] = pmodel.plan.to_json()
    return out


PARAM_TENSOR_RTOL = 1e-3


def assert_same_training(ref, par, rtol: float = 1e-5, what: str = "", tensor_rtol: float = PARAM_TENSOR_RTOL):
    """The oracle, at ``rtol`` relative:

    * every step's loss;
    * every gathered gradient of the first step, tensor by tensor;
    * the parameters (and buffers) after every AdamW step as one vector over the whole model.
      Tensor by tensor they must agree to ``tensor_rtol`` (PARAM_TENSOR_RTOL): a zero-initialised bias after
      one AdamW step is ±lr per element, so an element whose true gradient is ~0 moves by
      float noise in BOTH runs and a per-tensor 1e-5 would compare noise (docs/testing.md).
    """
    assert len(par["losses"]) == len(ref["losses"])
    for a, b in zip(par["losses"], ref["losses"]):
        assert abs(a - b) <= rtol * max(abs(b), 1e-6), f"{what} loss {a} != {b}"
    _close(par["grads"], ref["grads"], rtol, f"{what} grad")
    for i, (pa, pb) in enumerate(zip(par["params"], ref["params"])):
        _close(pa, pb, tensor_rtol, f"{what} params after step {i + 1}")
        keys = [k for k, v in pb.items() if v.is_floating_point()]
        got = torch.cat([pa[k].double().flatten() for k in keys])
        want = torch.cat([pb[k].double().flatten() for k in keys])
        err = rel_error(got, want)
        assert err <= rtol, f"{what} params after step {i + 1}: whole-model relative error {err:.3e} > {rtol:.0e}"


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
