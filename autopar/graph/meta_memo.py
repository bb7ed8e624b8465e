"""Outputs of meta-device ops kept per signature while one graph's values are propagated.

A rescaled step (``rescale.py``) re-runs every node on meta tensors to get its value at the new
batch; a model's repeated layers call the same ops on the same shapes, dtypes and strides, so each
distinct call is computed once and its output metadata reused: a fresh ``empty_strided`` meta tensor
of the same shape, stride, storage offset and dtype, what the op itself returns. Only ops whose
outputs alias nothing and which write none of their arguments (no views, no in-place ops), with
tensor or tuple-of-tensor outputs, are kept; every other call runs as before. Propagation runs under
``no_grad`` (the values are detached), so outputs carry no autograd history either way.
"""
from __future__ import annotations

import torch

_NO_KEY = object()


def _returns_fresh(op) -> bool:
    """Whether ``op``'s outputs are new tensors (no alias annotation) and it mutates no argument."""
    schema = getattr(op, "_schema", None)
    if schema is None or schema.is_mutable:
        return False
    return all(r.alias_info is None for r in schema.returns)


def _key(x):
    """A hashable description of an argument, or ``_NO_KEY`` where it has none."""
    if isinstance(x, torch.Tensor):
        if not x.is_meta:
            return _NO_KEY
        return ("T", tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.requires_grad)
    if isinstance(x, (list, tuple)):
        parts = tuple(_key(a) for a in x)
        return _NO_KEY if any(p is _NO_KEY for p in parts) else (type(x).__name__, parts)
    if isinstance(x, dict):
        parts = tuple((k, _key(v)) for k, v in x.items())
        return _NO_KEY if any(p is _NO_KEY for _, p in parts) else ("D", parts)
    if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                   torch.memory_format)):
        return (type(x).__name__, x)       # the type too: 1, 1.0 and True hash alike
    return _NO_KEY


def _describe(out):
    if isinstance(out, torch.Tensor) and out.is_meta:
        return (tuple(out.shape), out.stride(), out.storage_offset(), out.dtype)
    if isinstance(out, (list, tuple)) and out and all(isinstance(o, torch.Tensor) and o.is_meta for o in out):
        return type(out), tuple(_describe(o) for o in out)
    return None


def _made(d):
    if isinstance(d[0], type):
        return d[0](_made(o) for o in d[1])
    shape, stride, offset, dtype = d
    t = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return t.as_strided(shape, stride, offset) if offset else t


class MetaMemo:
    """Per graph propagation: ``call(op, args, kwargs, run)`` -> ``run(op, args, kwargs)``'s output,
    computed once per distinct signature of a fresh-output op."""

    def __init__(self):
        self.kept: dict = {}
        self.fresh: dict = {}

    def call(self, op, args, kwargs, run):
        fresh = self.fresh.get(op)
        if fresh is None:
            fresh = self.fresh[op] = isinstance(op, torch._ops.OpOverload) and _returns_fresh(op)
        if not fresh:
            return run(op, args, kwargs)
        a, k = _key(args), _key(kwargs)
        if a is _NO_KEY or k is _NO_KEY:
            return run(op, args, kwargs)
        key = (op, a, k)
        d = self.kept.get(key)
        if d is not None:
            return _made(d)
        out = run(op, args, kwargs)
        d = _describe(out)
        if d is not None:
            self.kept[key] = d
        return out
