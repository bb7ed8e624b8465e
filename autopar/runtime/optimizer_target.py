"""An optimizer built on the original model's parameters is refused at its first ``step()``.

``parallelize(model, ...)`` trains its own tensors (``pmodel.parameters()``: this rank's pieces);
the original ``model`` is left as it was. An optimizer built on ``model.parameters()`` after
``pmodel.step`` therefore finds no gradient and its ``step()`` silently does nothing, every step.
A global optimizer step pre-hook (registered with the first module noted) raises a RuntimeError
when an optimizer whose parameters have no gradient holds parameters of a model that was
parallelized, none of that module's own, while that module has run ``step`` since an optimizer
over its parameters last stepped (gradients waiting). ``pmodel.sync_to(model)`` copies the trained
state back into the original module (``runtime/sync_back.py``).
"""
from __future__ import annotations

import weakref

from torch.optim.optimizer import register_optimizer_step_pre_hook

_SOURCES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # pmodel -> {id: weakref} of model's params
_STEPPED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # pmodel -> its step count at its optimizer's
_HOOK: list = []


def note_source(pmodel, model) -> None:
    """Remember the module ``pmodel`` was built from (weakly: it may be freed)."""
    _SOURCES[pmodel] = {id(p): weakref.ref(p) for p in model.parameters()}
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: check_target(optimizer)))


def check_target(optimizer) -> None:
    """Raise if ``optimizer`` steps on an original model's parameters while its ParallelModule has gradients."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = {id(p) for p in params}
    for pmodel, source in list(_SOURCES.items()):
        if any(id(p) in ids for p in pmodel.parameters()):
            _STEPPED[pmodel] = pmodel._steps          # its own optimizer: the gradients are taken
            continue
        if any(p.grad is not None for p in params) or pmodel._steps <= _STEPPED.get(pmodel, 0):
            continue
        held = [p for p in params if (ref := source.get(id(p))) is not None and ref() is p]
        if held:
            raise RuntimeError(
                f"this {type(optimizer).__name__} holds {len(held)} parameter(s) of the original model, none of the "
                "parallelized module's: pmodel.step(...) puts the gradients on pmodel's own parameters, so this "
                "step would change nothing. Build the optimizer on pmodel.parameters() (e.g. "
                f"torch.optim.{type(optimizer).__name__}(pmodel.parameters(), ...)); the original model is not "
                "updated by training: copy the trained weights into it with pmodel.sync_to(model)")
