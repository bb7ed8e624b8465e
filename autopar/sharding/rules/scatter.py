"""Fresh tensors and slice writes: ``new_empty``/``new_zeros``/``new_ones``/``new_full`` and
``slice_scatter`` (what ``torch.export`` functionalises ``t = x.new_empty(...); t[..., :a].copy_(p);
t[..., a:].copy_(q)`` into: Hugging Face DeepSeek-V3's multi-head latent attention builds its keys so).

* ``new_*``: the output shards any dim its (unread) source has at the same size, the source split
  alike; ``passes/localize_shapes.py`` gives each rank its local size. The source's values are never
  read, so it is never gathered for this op.
* ``slice_scatter(x, src, dim, ...)``: ``x``, ``src`` and the output shard any dim but ``dim`` alike
  (each rank writes its rows of the slice); Partial passes through (linear in both).
"""
from __future__ import annotations

from torch.ops import aten

from autopar.sharding.placements import P, Shard
from autopar.sharding.registry import register_rule
from autopar.sharding.rules.common import arg
from autopar.sharding.strategy import AxisStrategy, shape_of, tensor_inputs

NEW_TENSOR_OPS = (aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default)


@register_rule(*NEW_TENSOR_OPS)
def new_tensor(node):
    src, out = shape_of(tensor_inputs(node)[0]), shape_of(node)
    if len(src) != len(out):
        return []
    return [AxisStrategy((Shard(d),), Shard(d), None, f"S{d}") for d in range(len(out)) if src[d] == out[d] and out[d] > 1]


@register_rule(aten.slice_scatter.default)
def slice_scatter(node):
    n = len(shape_of(node))
    dim = arg(node, 2, "dim", 0) % n
    opts = [AxisStrategy((P, P), P, None, "P")]
    for d in range(n):
        if d != dim:
            opts.append(AxisStrategy((Shard(d), Shard(d)), Shard(d), None, f"S{d}"))
    return opts
