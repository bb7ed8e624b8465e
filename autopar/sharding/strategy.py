"""Strategies: what placements an op accepts and produces, per mesh axis and over the mesh.

A rule (``autopar.sharding.rules``) answers for ONE mesh axis with ``AxisStrategy`` values;
``mesh_strategies`` forms their product over the axes and keeps the combinations whose
shards divide evenly. Tensor inputs are the fx nodes found in ``node.args``/``kwargs``
(flattened, in order): ``AxisStrategy.inputs`` lines up with ``tensor_inputs(node)``.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from autopar.sharding.placements import P, R, Partial, Replicate, Shard, Spec, spec_str


@dataclass(frozen=True)
class AxisStrategy:
    """One way to run an op along one mesh axis."""

    inputs: tuple            # Placement per tensor input
    output: object           # Placement, or tuple of Placements for multi-output ops
    local: str | None = None  # name of the local implementation this needs (None: the op itself)
    name: str = ""


@dataclass(frozen=True)
class Strategy:
    """One way to run an op on the whole mesh: an AxisStrategy per axis."""

    inputs: tuple            # Spec per tensor input
    output: object           # Spec, or tuple of Specs
    local: tuple             # per axis: local implementation name or None
    name: str

    def describe(self) -> str:
        outs = self.output if isinstance(self.output, tuple) and self.output and isinstance(self.output[0], tuple) \
            else (self.output,)
        ins = ", ".join(spec_str(s) for s in self.inputs)
        return f"{self.name}: ({ins}) -> {', '.join(spec_str(o) for o in outs)}"


_TENSOR_INPUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's tensor-valued input nodes, in argument order. Memoised per node while its
    ``args``/``kwargs`` objects stay the same (a pass that rewrites them assigns new ones)."""
    hit = _TENSOR_INPUTS.get(node)
    if hit is not None and hit[0] is node.args and hit[1] is node.kwargs:
        return list(hit[2])
    flat, _ = tree_flatten((node.args, node.kwargs))
    out = [a for a in flat if isinstance(a, fx.Node) and _is_tensor_val(a.meta.get("val"))]
    _TENSOR_INPUTS[node] = (node.args, node.kwargs, tuple(out))
    return out


def _is_tensor_val(v) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    return isinstance(v, (tuple, list)) and any(isinstance(t, torch.Tensor) for t in v)


def shape_of(node: fx.Node) -> tuple:
    v = node.meta.get("val")
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def out_shapes(node: fx.Node) -> list[tuple] | tuple:
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return tuple(v.shape)
    if isinstance(v, (tuple, list)):
        return [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in v]
    return ()


def replicate_all(node: fx.Node) -> AxisStrategy:
    n_in = len(tensor_inputs(node))
    v = node.meta.get("val")
    out = tuple(R for _ in v) if isinstance(v, (tuple, list)) else R
    return AxisStrategy(tuple(R for _ in range(n_in)), out, None, "replicate")


def _spec_ok(shape, spec: Spec, mesh_shape) -> bool:
    """Every sharded dim divides evenly by the axes that shard it (block-wise for chunks)."""
    if shape is None:
        return True
    per_dim: dict[int, list] = {}
    for axis, p in enumerate(spec):
        if isinstance(p, Shard):
            if not shape or p.dim >= len(shape) or p.dim < -len(shape):
                return False
            per_dim.setdefault(p.dim % len(shape), []).append((mesh_shape[axis], (p.chunks, p.zigzag)))
    for dim, pieces in per_dim.items():
        chunks = {c for _, c in pieces}
        if len(chunks) > 1:
            return False
        n = 1
        for s, _ in pieces:
            n *= s
        size = shape[dim]
        c = chunks.pop()[0]
        if size % c or (size // c) % n:
            return False
    return True


def _combine(node, axis_choices, mesh_shape, in_shapes, outs) -> Strategy | None:
    n_in = len(in_shapes)
    inputs = tuple(tuple(ch.inputs[i] for ch in axis_choices) for i in range(n_in))
    multi = isinstance(outs, list)
    if multi:
        output = tuple(tuple(ch.output[k] for ch in axis_choices) for k in range(len(outs)))
    else:
        output = tuple(ch.output for ch in axis_choices)
    for shape, spec in zip(in_shapes, inputs):
        if not _spec_ok(shape, spec, mesh_shape):
            return None
    for shape, spec in (zip(outs, output) if multi else [(outs, output)]):
        if not _spec_ok(shape, spec, mesh_shape):
            return None
    locals_ = tuple(ch.local for ch in axis_choices)
    if len({l.split(":")[0] for l in locals_ if l}) > 1:
        return None
    name = "×".join(ch.name or "?" for ch in axis_choices)
    return Strategy(inputs, output, locals_, name)


_MESH_STRATEGIES: dict[tuple, list[Strategy]] = {}


def mesh_strategies(node: fx.Node, axis_options: list[AxisStrategy], mesh_shape, limit: int = 64) -> list[Strategy]:
    """All valid combinations of per-axis strategies (replicate-everything always first); a pure
    function of the options, the mesh and the node's shapes, memoised (repeated layers ask alike)."""
    in_shapes = [shape_of(a) for a in tensor_inputs(node)]
    outs = out_shapes(node)
    base = replicate_all(node)
    key = (tuple(axis_options), tuple(mesh_shape), tuple(in_shapes), tuple(outs) if isinstance(outs, list) else outs,
           base, limit)
    cached = _MESH_STRATEGIES.get(key)
    if cached is None:
        if len(_MESH_STRATEGIES) > 20000:
            _MESH_STRATEGIES.clear()
        cached = _MESH_STRATEGIES[key] = _combinations(node, base, axis_options, mesh_shape, in_shapes, outs, limit)
    return list(cached)


def _combinations(node, base, axis_options, mesh_shape, in_shapes, outs, limit) -> list[Strategy]:
    """The first ``limit`` valid combinations in product order (the first mesh axis varies slowest); an
    axis of size 1 replicates (a split over one device is the whole tensor, and its collectives and local
    forms, such as a loss summed per rank then divided, would only round differently).
    When that cuts some off, the last ``limit // 4`` places go to combinations that split the output
    on every mesh axis (``_fully_split``): product order alone keeps only the first options of the
    outer axes, so on three or more axes a view could not keep a batch x sequence x heads split its
    neighbours all use (its strategy came after the cut) and the plan gathered the value instead."""
    options = [base] + [o for o in axis_options if o != base]
    seen, result = set(), []
    for combo in itertools.product(*[options if size > 1 else options[:1] for size in mesh_shape]):
        st = _combine(node, combo, mesh_shape, in_shapes, outs)
        if st is None:
            continue
        key = (st.inputs, st.output, st.local)
        if key in seen:
            continue
        seen.add(key)
        result.append(st)
        if len(result) >= limit:
            return _with_fully_split(node, options, mesh_shape, in_shapes, outs, result, limit)
    return result


def _with_fully_split(node, options, mesh_shape, in_shapes, outs, result: list[Strategy], limit: int) -> list[Strategy]:
    """``result`` (``limit`` combinations in product order, more cut off) with its last places given
    to fully split combinations it lacks (``_combinations``), in product order after the others."""
    key = lambda st: (st.inputs, st.output, st.local)   # noqa: E731
    head = result[:limit - limit // 4]
    extra = _fully_split(node, options, mesh_shape, in_shapes, outs, {key(st) for st in head}, limit // 4)
    taken = {key(st) for st in head + extra}
    tail = [st for st in result[len(head):] if key(st) not in taken]
    return head + tail[:limit - len(head) - len(extra)] + extra


def _splits(o: AxisStrategy) -> bool:
    """Whether an axis option leaves the (first) output split (a Shard, not replicated or partial)."""
    out = o.output[0] if isinstance(o.output, tuple) else o.output
    return isinstance(out, Shard)


def _fully_split(node, options, mesh_shape, in_shapes, outs, seen: set, count: int) -> list[Strategy]:
    """Up to ``count`` valid combinations not in ``seen`` whose output is split on every axis of size > 1."""
    per_axis = [[o for o in options if _splits(o)] if size > 1 else options[:1] for size in mesh_shape]
    out = []
    for combo in itertools.product(*per_axis):
        if len(out) >= count:
            break
        st = _combine(node, combo, mesh_shape, in_shapes, outs)
        if st is not None and (st.inputs, st.output, st.local) not in seen:
            seen.add((st.inputs, st.output, st.local))
            out.append(st)
    return out


def is_partial(p) -> bool:
    return isinstance(p, Partial)


def is_replicate(p) -> bool:
    return isinstance(p, Replicate)


__all__ = ["AxisStrategy", "Strategy", "tensor_inputs", "shape_of", "out_shapes", "mesh_strategies",
           "replicate_all", "P", "R", "Shard", "field"]
