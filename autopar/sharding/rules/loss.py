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
        if reduction != _NONE:
            opts += [AxisStrategy((Shard(0, k), Shard(0, k)) + extra, P, "loss:batch", f"batch/{k}")
                     for k in _row_blocks(ins[0])]
    if (node.target == aten.cross_entropy_loss.default and len(x) == 2 and not smoothing and len(ins) == 2
            and reduction != _NONE):
        opts.append(AxisStrategy((Shard(1), R), R, "loss:vocab", "vocab"))
    return opts


def _row_blocks(x) -> list[int]:
    """Block counts under which the rows of ``x`` may arrive split block-wise: ``x`` a flatten of
    ``[B, T, ...]`` into ``[B*T, ...]`` with T split (a sequence split) is ``Shard(0, chunks=B)``.
    The batch-split loss sums its rows over the global count, so any row split is exact."""
    src = shape_of(x.args[0]) if x.op == "call_function" and x.args and hasattr(x.args[0], "meta") else ()
    dst = shape_of(x)
    if len(src) <= len(dst) or not dst:
        return []
    out, k = [], 1
    for d in src[:len(src) - len(dst) + 1]:
        if k > 1 and dst[0] % k == 0:
            out.append(k)
        k *= d
    return out


@register_rule(aten.mse_loss.default, aten.smooth_l1_loss.default, aten.huber_loss.default,
               aten.binary_cross_entropy_with_logits.default, aten.binary_cross_entropy.default)
def elementwise_loss(node):
    """Elementwise losses: shard any dim of input and target alike. Mean → the local mean
    rescaled by the shard count (Partial); sum → Partial; none → sharded like the input."""
    ins = tensor_inputs(node)
    if len(ins) != 2 or shape_of(ins[0]) != shape_of(ins[1]):
        return []
    if node.target in (aten.binary_cross_entropy_with_logits.default, aten.binary_cross_entropy.default):
        reduction = arg(node, 4 if node.target == aten.binary_cross_entropy_with_logits.default else 3,
                        "reduction", _MEAN)
    else:
        reduction = arg(node, 2, "reduction", _MEAN)
    opts = []
    for d in range(len(shape_of(ins[0]))):
        if reduction == _NONE:
            opts.append(AxisStrategy((Shard(d), Shard(d)), Shard(d), None, f"S{d}"))
        else:
            opts.append(AxisStrategy((Shard(d), Shard(d)), P, "mean:scale" if reduction == _MEAN else None,
                                     f"S{d}→P"))
    return opts
