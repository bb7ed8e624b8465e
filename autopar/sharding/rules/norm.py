"""layer_norm / rms_norm (normalised dims whole) and batch_norm (batch split with synced
statistics, or channel split)."""
from __future__ import annotations

from torch.ops import aten

from autopar.sharding.placements import R, Shard
from autopar.sharding.registry import register_rule
from autopar.sharding.rules.common import arg
from autopar.sharding.strategy import AxisStrategy, shape_of, tensor_inputs


@register_rule(aten.layer_norm.default, aten.rms_norm.default)
def layer_norm(node):
    ins = tensor_inputs(node)
    n = len(shape_of(ins[0]))
    k = len(arg(node, 1, "normalized_shape"))
    opts = []
    for d in range(n - k):
        opts.append(AxisStrategy((Shard(d),) + tuple(R for _ in ins[1:]), Shard(d), None, f"S{d}"))
    return opts


@register_rule(aten.batch_norm.default)
def batch_norm(node):
    ins = tensor_inputs(node)
    training = bool(arg(node, 5, "training"))
    rest = len(ins) - 1
    opts = [AxisStrategy((Shard(0),) + tuple(R for _ in range(rest)), Shard(0),
                         "batch_norm:sync" if training else None, "S0(sync)" if training else "S0")]
    if len(shape_of(ins[0])) > 1:
        opts.append(AxisStrategy((Shard(1),) + tuple(Shard(0) for _ in range(rest)), Shard(1), None, "C"))
    return opts
