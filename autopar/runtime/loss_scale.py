"""Dynamic loss scaling for ``mixed_precision="fp16"``: torch.amp.GradScaler's recipe, kept by the
module so the standard loop ``loss = pmodel.step(x, target=y); opt.step(); opt.zero_grad()`` is right.

* ``pmodel.step`` backpropagates ``loss * scale`` (fp16 gradients keep their small values);
* before the optimizer sees the gradients (a global optimizer step pre-hook, ``clip_grad_norm_``,
  ``full_grad_dict``) they are summed (the pending no_sync/ZeRO sums), checked for inf/nan and
  multiplied by ``1 / scale`` in fp32. The check is one all-reduce (MAX) of a flag over the WORLD
  group, so every rank, pipeline stage and ZeRO shard reaches the same verdict;
* an optimizer step after an overflow is skipped (the gradients of its parameters are set to None,
  so it changes neither parameters nor state, like ``GradScaler.step``) and the scale is multiplied
  by ``backoff_factor``; after ``growth_interval`` clean steps in a row it is multiplied by
  ``growth_factor`` (``GradScaler.update``). Several optimizers over one module share one verdict.

A ``step`` after the gradients were unscaled (e.g. ``full_grad_dict`` between accumulating steps)
scales them back first, so the sum stays in one unit.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autopar.collectives.watch import note
from autopar.core.context import LossScaling, get_auto_parallel_context

_SCALED, _UNSCALED, _STEPPED = "scaled", "unscaled", "stepped"


class LossScaler:
    """One module's loss scale and its gradients' state (scaled, unscaled, stepped)."""

    def __init__(self, pmodel, settings: LossScaling):
        self.settings = settings
        self.scale = float(settings.init_scale)
        self.growth_tracker = 0           # clean steps since the scale last changed
        self.found_inf = False            # the verdict of the last unscale
        self.skipped_steps = 0
        self._state = _STEPPED
        self._pmodel = weakref.ref(pmodel)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.skipped_steps = int(state.get("skipped_steps", 0))

    def before_backward(self) -> float:
        """The factor the loss is multiplied by; gradients already unscaled (no step since) are rescaled."""
        if self._state == _UNSCALED:
            for g, _ in self._pmodel()._grad_pieces():
                g.mul_(self.scale)
        self._state = _SCALED
        return self.scale

    def unscale(self) -> bool:
        """Sum, check (over every rank) and unscale the gradients once per step; True if any is inf/nan."""
        if self._state != _SCALED:
            return self.found_inf
        pmodel = self._pmodel()
        pmodel._flush_grads()
        grads = [g for g, _ in pmodel._grad_pieces()]
        flag = torch.zeros(())
        for g in grads:
            if not bool(torch.isfinite(g).all()):
                flag.fill_(1.0)
                break
        if dist.is_initialized() and dist.get_world_size() > 1:
            note("all_reduce", "+".join(pmodel.plan.mesh.axis_names), "step",
                 detail="of the loss scaler's inf/nan flag")
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pmodel._world)
        inv = 1.0 / self.scale
        for g in grads:
            g.mul_(inv)
        self.found_inf = bool(flag.item() > 0)
        self._state = _UNSCALED
        return self.found_inf

    def before_optimizer_step(self, optimizer) -> None:
        """Unscale if needed, skip this optimizer's step after an overflow, update the scale once."""
        if self._state == _SCALED:
            self.unscale()
        if self._state == _UNSCALED:
            self._update()
        if self.found_inf:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None

    def _update(self) -> None:
        s = self.settings
        if self.found_inf:
            self.scale *= s.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
        else:
            self.growth_tracker += 1
            if self.growth_tracker == s.growth_interval:
                self.scale *= s.growth_factor
                self.growth_tracker = 0
        self._state = _STEPPED


_SCALERS: "weakref.WeakSet[LossScaler]" = weakref.WeakSet()


def make_scaler(pmodel, plan) -> LossScaler | None:
    """A scaler for a plan with ``mixed_precision="fp16"`` (None otherwise), set by the context's
    ``loss_scaling``."""
    if plan.memory_options.mixed_precision != "fp16":
        return None
    scaler = LossScaler(pmodel, LossScaling.of(get_auto_parallel_context()["loss_scaling"]))
    _SCALERS.add(scaler)
    return scaler


def _before_step(optimizer, args, kwargs) -> None:
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for scaler in list(_SCALERS):
        pmodel = scaler._pmodel()
        if pmodel is not None and any(id(p) in ids for p in pmodel.parameters()):
            with pmodel._guard("optimizer.step (fp16 loss scaling: checking the gradients for inf/nan)"):
                scaler.before_optimizer_step(optimizer)


register_optimizer_step_pre_hook(_before_step)
