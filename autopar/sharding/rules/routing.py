"""Ops of mixture-of-experts routers: ``topk``, ``gather``, ``scatter`` (value and src) and ``zeros_like``.

DeepSeek-V3's group-limited router (Hugging Face ``DeepseekV3TopkRouter``) picks groups by ``topk`` of
each group's two best scores, marks them with ``zeros_like`` + ``scatter``, masks the other groups' experts
and takes the top 8 (``topk``), then ``gather``s their weights. Without rules each of these ran
replicated, so every rank all-gathered the router's scores of the whole batch (on DeepSeek-V3's
forced layout: 512 MiB over dp and 256 MiB over ep per layer and microbatch) and routed every token.
Each op works along one dim and is independent across the others:

* ``topk(x, k, dim)``: x, values and indices shard any dim but ``dim`` alike;
* ``gather(x, dim, index)`` and ``scatter(x, dim, index, value | src)``: x, index (src) and the output
  shard any dim but ``dim`` alike (the index rows of a shard address its own rows), where their sizes
  there are equal;
* ``zeros_like(x)``: the output shards any dim of x alike (its values are never read).
"""
from __future__ import annotations

from torch.ops import aten

from autopar.sharding.placements import Shard
from autopar.sharding.registry import register_rule
from autopar.sharding.rules.common import arg
from autopar.sharding.strategy import AxisStrategy, shape_of, tensor_inputs


def _dims_but(node, dim_index: int, default: int) -> list[int]:
    """Dims of the output other than the op's own ``dim``, of size > 1 and equal on every tensor input."""
    out = shape_of(node)
    n = len(out)
    if n == 0:
        return []
    dim = arg(node, dim_index, "dim", default) % n
    shapes = [shape_of(a) for a in tensor_inputs(node)]
    return [d for d in range(n) if d != dim and out[d] > 1 and all(len(s) == n and s[d] == out[d] for s in shapes)]


@register_rule(aten.topk.default)
def topk(node):
    n_in = len(tensor_inputs(node))
    return [AxisStrategy((Shard(d),) * n_in, (Shard(d), Shard(d)), None, f"S{d}")
            for d in _dims_but_topk(node)]


def _dims_but_topk(node) -> list[int]:
    x = shape_of(tensor_inputs(node)[0])
    n = len(x)
    if n == 0:
        return []
    dim = arg(node, 2, "dim", -1) % n
    return [d for d in range(n) if d != dim and x[d] > 1]


@register_rule(aten.gather.default, aten.scatter.value, aten.scatter.src)
def gather_scatter(node):
    n_in = len(tensor_inputs(node))
    return [AxisStrategy((Shard(d),) * n_in, Shard(d), None, f"S{d}") for d in _dims_but(node, 1, 0)]


@register_rule(aten.zeros_like.default)
def zeros_like(node):
    out = shape_of(node)
    return [AxisStrategy((Shard(d),), Shard(d), None, f"S{d}") for d in range(len(out)) if out[d] > 1]
