"""Helpers shared by the rule files."""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.sharding.placements import P, R, Shard
from autopar.sharding.strategy import AxisStrategy, shape_of, tensor_inputs


def ndim(node: fx.Node) -> int:
    return len(shape_of(node))


def arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def chunk_hint(node: fx.Node) -> int:
    """k > 1 when this node's last dim is split into k equal parts downstream (fused QKV)."""
    return node.meta.get("chunk_hint", 1)


def pointwise_options(node: fx.Node, linear: str = "none", skip_dims=()) -> list[AxisStrategy]:
    """Elementwise ops with broadcasting.

    Shard any output dim (inputs shard their aligned dim, broadcast inputs stay R).
    ``linear``: "unary" (f(P)=P), "all" (f(P,P)=P, e.g. add), "each" (f(P,R)=P for each
    input, e.g. mul), "first" (only the first input may be P, e.g. div).
    """
    out = shape_of(node)
    ins = tensor_inputs(node)
    shapes = [shape_of(a) for a in ins]
    opts = []
    hint = chunk_hint(node)
    n = len(out)
    for d in range(n):
        if out[d] == 1 or d in skip_dims or (d - n) in skip_dims:
            continue
        for k in ({1, hint} if d == n - 1 else {1}):
            placements = []
            for s in shapes:
                off = n - len(s)
                j = d - off
                placements.append(Shard(j, k) if j >= 0 and s[j] == out[d] and s[j] != 1 else R)
            opts.append(AxisStrategy(tuple(placements), Shard(d, k), None, f"S{d}" + (f"/{k}" if k > 1 else "")))
    if ins and linear != "none":
        if linear in ("unary", "all"):
            opts.append(AxisStrategy(tuple(P for _ in ins), P, None, "P"))
        elif linear == "each":
            for i in range(len(ins)):
                opts.append(AxisStrategy(tuple(P if j == i else R for j in range(len(ins))), P, None, f"P{i}"))
        elif linear == "first":
            opts.append(AxisStrategy((P,) + tuple(R for _ in ins[1:]), P, None, "P0"))
    return opts


def is_scalar_like(v) -> bool:
    return not isinstance(v, (fx.Node, torch.Tensor))
