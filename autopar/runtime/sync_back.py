"""``pmodel.sync_to(model)``: the trained state copied back into the original module, in place.

Training through ``parallelize`` updates ``pmodel``'s own tensors (this rank's pieces); the module
it was built from keeps the weights it had. ``sync_to`` gathers the full state
(``pmodel.full_state_dict()``, a collective: call it on every rank) and copies it into ``model``'s
parameters and buffers on every rank, in place (the tensors keep their identity, so an optimizer
or a reference to them sees the new values). A model on the meta device has no storage to copy
into and is refused before anything is gathered; so is a model of another structure.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn


def sync_to(model: nn.Module, gather: Callable[[], dict]) -> None:
    """Copy ``gather()`` (the full state dict) into ``model``'s tensors in place."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"pmodel.sync_to(model) takes the torch.nn.Module pmodel was built from, got "
                        f"{type(model).__name__}")
    own = model.state_dict(keep_vars=True)
    meta = [k for k, t in own.items() if isinstance(t, torch.Tensor) and t.is_meta]
    if meta:
        raise ValueError(f"pmodel.sync_to(model): the model's {meta[0]!r} ({len(meta)} tensor(s) in all) is on the meta "
                         "device, with no storage to copy into; give it storage first (model.to_empty(device='cpu')), "
                         "or read the trained state with pmodel.full_state_dict()")
    full = gather()
    missing = [k for k in own if k not in full]
    wrong = [f"{k} {list(own[k].shape)} here, {list(full[k].shape)} trained" for k in own
             if k in full and tuple(own[k].shape) != tuple(full[k].shape)]
    if missing or wrong:
        what = f"has {missing[0]!r}, which the trained module does not" if missing else f"differs: {wrong[0]}"
        raise ValueError(f"pmodel.sync_to(model): the model {what}; pass the module pmodel was built from (or one "
                         "of the same structure)")
    with torch.no_grad():
        for k, t in own.items():
            if isinstance(t, torch.Tensor):
                t.copy_(full[k])
