"""sum / mean (a sharded reduced dim gives Partial; mean rescales locally), softmax-like ops
(the normalised dim stays whole), cumsum, amax."""
from __future__ import annotations

from torch.ops import aten

from autopar.sharding.placements import P, Shard
from autopar.sharding.registry import register_rule
from autopar.sharding.rules.common import arg, pointwise_options
from autopar.sharding.strategy import AxisStrategy, shape_of, tensor_inputs


def _reduce_options(node, scale_local: str | None, linear: bool) -> list[AxisStrategy]:
    src = shape_of(tensor_inputs(node)[0])
    n = len(src)
    dims = arg(node, 1, "dim", None)
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(n))
    if isinstance(dims, int):
        dims = [dims]
    dims = sorted({d % n for d in dims}) if n else []
    keep = bool(arg(node, 2, "keepdim", False)) and node.target not in (aten.sum.default, aten.mean.default)
    opts = [AxisStrategy((P,), P, None, "P")] if linear else []
    for d in range(n):
        if d in dims:
            if linear:
                opts.append(AxisStrategy((Shard(d),), P, scale_local, f"S{d}→P"))
        else:
            out_d = d if keep else d - sum(1 for r in dims if r < d)
            opts.append(AxisStrategy((Shard(d),), Shard(out_d), None, f"S{d}"))
    return opts


@register_rule(aten.sum.dim_IntList, aten.sum.default)
def sum_(node):
    return _reduce_options(node, None, True)


@register_rule(aten.mean.dim, aten.mean.default)
def mean(node):
    return _reduce_options(node, "mean:scale", True)


@register_rule(aten.amax.default, aten.amin.default, aten.argmax.default, aten.var.correction, aten.std.correction)
def nonlinear_reduce(node):
    return _reduce_options(node, None, False)


@register_rule(aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
               aten.cumsum.default)
def softmax(node):
    n = len(shape_of(node))
    return pointwise_options(node, skip_dims=(arg(node, 1, "dim") % n,))


@register_rule(aten.tril.default, aten.triu.default)
def tril(node):
    return pointwise_options(node, skip_dims=(-1, -2))
