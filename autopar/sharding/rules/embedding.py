"""embedding: split the ids (data), the hidden dim, or the vocabulary (Megatron's
vocab-parallel embedding: masked local lookup, Partial output)."""
from __future__ import annotations

from torch.ops import aten

from autopar.sharding.placements import P, R, Shard
from autopar.sharding.registry import register_rule
from autopar.sharding.strategy import AxisStrategy, shape_of, tensor_inputs


@register_rule(aten.embedding.default)
def embedding(node):
    w, ids = tensor_inputs(node)[:2]
    n = len(shape_of(ids))
    opts = [AxisStrategy((R, Shard(d)), Shard(d), None, f"ids S{d}") for d in range(n)]
    opts.append(AxisStrategy((Shard(1), R), Shard(n), None, "hidden"))
    opts.append(AxisStrategy((Shard(0), R), P, "embedding:vocab", "vocab"))
    return opts
