"""cross_entropy / nll_loss: split the batch (local sum over the global count, Partial out)
or the classes (Megatron's vocab-parallel cross entropy)."""
from __future__ import annotations

from torch.ops import aten

from autopar.sharding.placements import P, R, Shard
from autopar.sharding.registry import register_rule
from autopar.sharding.rules.common import arg
from autopar.sharding.strategy import AxisStrategy, shape_of, tensor_inputs

_NONE, _MEAN, _SUM = 0, 1, 2


@register_rule(aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default)
def cross_entropy(node):
    ins = tensor_inputs(node)
    x = shape_of(ins[0])
    reduction = arg(node, 3, "reduction", _MEAN)
    smoothing = arg(node, 5, "label_smoothing", 0.0) if node.target == aten.cross_entropy_loss.default else 0.0
    extra = tuple(R for _ in ins[2:])
    opts = []
    if len(x) >= 1 and len(shape_of(ins[1])) >= 1:
        out = Shard(0) if reduction == _NONE else P
        opts.append(AxisStrategy((Shard(0), Shard(0)) + extra, out, "loss:batch", "batch"))
    if (node.target == aten.cross_entropy_loss.default and len(x) == 2 and not smoothing and len(ins) == 2
            and reduction != _NONE):
        opts.append(AxisStrategy((Shard(1), R), R, "loss:vocab", "vocab"))
    return opts
