"""scaled_dot_product_attention: split batch or heads (the mask follows where it has the dim)."""
from __future__ import annotations

from torch.ops import aten

from autopar.sharding.placements import R, Shard
from autopar.sharding.registry import register_rule
from autopar.sharding.strategy import AxisStrategy, shape_of, tensor_inputs


@register_rule(aten.scaled_dot_product_attention.default)
def sdpa(node):
    ins = tensor_inputs(node)
    q, k = shape_of(ins[0]), shape_of(ins[1])
    opts = []
    for d in range(len(q) - 2):
        if d == len(q) - 3 and q[d] != k[d]:
            continue  # grouped-query heads: keep heads whole
        pl = []
        for a in ins:
            s = shape_of(a)
            j = d - (len(q) - len(s))
            pl.append(Shard(j) if j >= 0 and s[j] != 1 else R)
        opts.append(AxisStrategy(tuple(pl), Shard(d), None, "heads" if d == len(q) - 3 else f"S{d}"))
    return opts
