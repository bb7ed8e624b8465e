"""A rank whose pipeline stage holds no parameters still offers ``pmodel.parameters()`` to an optimizer.

The partition solver (``solver/inter_op.py``) gives every stage parameters whenever some cut does,
but a requested pipeline (a ``pp`` mesh axis, stage tags, a HYBRID plan) may leave a stage that
only pools or reshapes. torch refuses an optimizer over no parameters ("optimizer got an empty
parameter list"), which would break the standard loop on that rank alone while its peers wait in
their p2p receives. So ``pmodel.parameters()`` on such a rank yields one zero-size placeholder
parameter: never used by the program, never given a gradient (so every optimizer step skips it),
not a registered parameter (absent from ``named_parameters()``, ``state_dict()``,
``full_state_dict()`` and checkpoints: ``pmodel.save(optimizer=...)`` names it ``NAME`` and writes
no state for it, and a load gives it none).
"""
from __future__ import annotations

import torch
import torch.nn as nn

_ATTR = "_autopar_idle_placeholder"
NAME = "<autopar: placeholder of a rank without parameters>"   # its name in an optimizer's groups (checkpoints)


def parameters(pmodel: nn.Module, recurse: bool = True):
    """``pmodel``'s parameters, or the placeholder where it holds none."""
    found = False
    for _, p in pmodel.named_parameters(recurse=recurse):
        found = True
        yield p
    if not found:
        yield placeholder(pmodel)


def placeholder(pmodel: nn.Module) -> nn.Parameter:
    """The module's zero-size placeholder parameter (made once, kept outside its registered parameters)."""
    p = pmodel.__dict__.get(_ATTR)
    if p is None:
        p = nn.Parameter(torch.empty(0))
        object.__setattr__(pmodel, _ATTR, p)
    return p


def is_placeholder(pmodel: nn.Module, tensor) -> bool:
    return pmodel.__dict__.get(_ATTR) is tensor
