"""Rewrite shape arguments (view/reshape/expand/new_* sizes, split sizes) to this rank's local shapes."""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.ops import aten

from autopar.plan.specs import PlanSpecs
from autopar.sharding.placements import Shard, local_shape

_SIZE_ARG = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
             aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default}
_SPLITS = {aten.split.Tensor, aten.unsafe_split.Tensor, aten.split_with_sizes.default}


def _dim_factor(spec, dim: int, ndim: int, mesh_shape) -> int:
    f = 1
    for a, p in enumerate(spec):
        if isinstance(p, Shard) and p.dim % ndim == dim % ndim:
            f *= mesh_shape[a]
    return f


def localize_shapes(gm: fx.GraphModule, plan, mesh_shape: tuple) -> fx.GraphModule:
    specs = PlanSpecs(plan, len(mesh_shape))
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.name not in plan.nodes:
            continue
        val = node.meta.get("val")
        if node.target in _SIZE_ARG and isinstance(val, torch.Tensor):
            out = local_shape(tuple(val.shape), specs.output_specs(node)[0], mesh_shape)
            node.args = (node.args[0], list(out)) + tuple(node.args[2:])
        elif node.target == aten.unflatten.int and isinstance(val, torch.Tensor):
            dim, sizes = node.args[1], node.args[2]
            out = local_shape(tuple(val.shape), specs.output_specs(node)[0], mesh_shape)
            d = dim % (val.dim() - len(sizes) + 1)
            node.args = (node.args[0], dim, list(out[d:d + len(sizes)]))
        elif node.target in _SPLITS:
            src = node.args[0]
            ndim = _global_ndim(src)
            dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
            f = _dim_factor(specs.input_specs(node)[0], dim, ndim, mesh_shape)
            if f > 1:
                size = node.args[1]
                size = [s // f for s in size] if isinstance(size, (list, tuple)) else size // f
                node.args = (src, size) + tuple(node.args[2:])
    gm.recompile()
    return gm


def _global_ndim(node) -> int:
    """Rank of a value; collectives the passes inserted carry no ``val``, their input does."""
    while "val" not in node.meta and node.args:
        node = node.args[0]
    return node.meta["val"].dim()
