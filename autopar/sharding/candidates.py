"""Candidate strategies for every node of a traced graph on a mesh.

Placeholders (parameters, buffers, inputs) choose a spec (R or Shard(d) per axis); call
nodes choose among ``mesh_strategies`` of their rule; ``getitem`` takes its producer's
placement; ops without a rule get the replicate-only strategy and are listed as unknown.
"""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.ops import aten

from autopar.core import search_memo
from autopar.sharding.placements import R, Shard
from autopar.sharding.rules import axis_options, has_rule
from autopar.sharding.strategy import Strategy, mesh_strategies, replicate_all, shape_of

DROPPED = {aten._assert_tensor_metadata.default}


@dataclass
class Candidates:
    strategies: dict[str, list[Strategy]] = field(default_factory=dict)   # node name -> options
    unknown_ops: dict[str, str] = field(default_factory=dict)             # node name -> op


def placeholder_strategies(node: fx.Node, mesh_shape, allow_shard: bool = True) -> list[Strategy]:
    """R everywhere first, then every even Shard(dim[, chunks]) per axis of size > 1."""
    v = node.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return [Strategy((), tuple(R for _ in mesh_shape), tuple(None for _ in mesh_shape), "R")]
    shape = tuple(v.shape)
    per_axis = [R]
    if allow_shard:
        hint = node.meta.get("chunk_hint", 1)
        for d, size in enumerate(shape):
            if size > 1:
                per_axis.append(Shard(d))
                if hint > 1 and size % hint == 0:
                    per_axis.append(Shard(d, hint))
    out = []
    for combo in itertools.product(*[per_axis if size > 1 else [R] for size in mesh_shape]):
        if _even(shape, combo, mesh_shape):
            out.append(Strategy((), tuple(combo), tuple(None for _ in mesh_shape), "".join(str(p) for p in combo)))
    return out


def _even(shape, spec, mesh_shape) -> bool:
    from autopar.sharding.strategy import _spec_ok

    return _spec_ok(shape, spec, mesh_shape)


def is_dropped(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in DROPPED


def build_candidates(gm: fx.GraphModule, mesh_shape, mutated_buffers: set[str] = frozenset()) -> Candidates:
    """Every node's candidate strategies on ``mesh_shape``. Under ``search_memo``, nodes whose lists are
    the same function of the mesh (``_candidate_classes``: repeated layers' nodes) share one list object,
    built once per call."""
    if search_memo.ENABLED and hasattr(gm, "meta"):
        return _shared_candidates(gm, mesh_shape)
    return _plain_candidates(gm, mesh_shape)


def _plain_candidates(gm: fx.GraphModule, mesh_shape) -> Candidates:
    c = Candidates()
    options = _options_once(gm)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            c.strategies[node.name] = placeholder_strategies(node, mesh_shape)
        elif node.op == "call_function":
            if node.target is operator.getitem or is_dropped(node):
                continue
            if not has_rule(node.target):
                c.unknown_ops[node.name] = str(node.target)
                c.strategies[node.name] = mesh_strategies(node, [], mesh_shape)
                continue
            opts = options(node)
            strategies = mesh_strategies(node, opts, mesh_shape)
            c.strategies[node.name] = strategies or mesh_strategies(node, [replicate_all(node)], mesh_shape)
    return c


def _shared_candidates(gm: fx.GraphModule, mesh_shape) -> Candidates:
    """``_plain_candidates``' lists, one per candidate class (the same lists by value, the nodes of one
    class holding the same list object)."""
    c = Candidates()
    classes = _candidate_classes(gm)
    built: dict[int, list[Strategy]] = {}
    for node in gm.graph.nodes:
        cls = classes(node)
        if cls is None:
            continue
        if node.op == "call_function" and not has_rule(node.target):
            c.unknown_ops[node.name] = str(node.target)
        kept = built.get(cls[0])
        if kept is None:
            kept = built[cls[0]] = _plain_strategies(node, cls[1], mesh_shape)
        c.strategies[node.name] = kept
    return c


def _plain_strategies(node: fx.Node, opts, mesh_shape) -> list[Strategy]:
    """One node's list as ``_plain_candidates`` builds it (``opts``: its rule's axis options, None: no rule)."""
    if node.op == "placeholder":
        return placeholder_strategies(node, mesh_shape)
    if opts is None:
        return mesh_strategies(node, [], mesh_shape)
    return mesh_strategies(node, list(opts), mesh_shape) or mesh_strategies(node, [replicate_all(node)], mesh_shape)


def _candidate_classes(gm: fx.GraphModule):
    """node -> (class number, its rule's options or None) or None (no candidates: getitem, dropped ops),
    once per graph (kept in ``gm.meta``): two nodes of one class get equal lists on every mesh, since
    their lists are the same function of the mesh shape (``placeholder_strategies`` of the shape and
    chunk hint; ``mesh_strategies`` of the options, the input and output shapes and the replicate-all
    strategy, its memo key less the mesh)."""
    cache = search_memo.graph_cache(gm, "candidate_classes", by_node={}, ids={})
    by_node, ids = cache["by_node"], cache["ids"]
    options = _options_once(gm)

    def classes(node: fx.Node):
        hint = node.meta.get("chunk_hint", 1)
        hit = by_node.get(node.name)
        if hit is None or hit[0] is not node or hit[1] != hint:
            hit = by_node[node.name] = (node, hint, _class_of(node, options, ids))
        return hit[2]
    return classes


def _class_of(node: fx.Node, options, ids: dict):
    from autopar.sharding.strategy import out_shapes, tensor_inputs

    if node.op == "placeholder":
        v = node.meta.get("val")
        sig = ("placeholder", tuple(v.shape) if isinstance(v, torch.Tensor) else None,
               node.meta.get("chunk_hint", 1))
        return ids.setdefault(sig, len(ids)), None
    if node.op != "call_function" or node.target is operator.getitem or is_dropped(node):
        return None
    opts = tuple(options(node)) if has_rule(node.target) else None
    outs = out_shapes(node)
    sig = ("call", opts, tuple(shape_of(a) for a in tensor_inputs(node)), tuple(outs) if isinstance(outs, list)
           else outs, replicate_all(node))
    return ids.setdefault(sig, len(ids)), opts


def _options_once(gm: fx.GraphModule):
    """``axis_options`` of a node, once per graph (kept in ``gm.meta``): a rule's options depend on the
    node alone, and the search builds one graph's candidates on several meshes."""
    if not search_memo.ENABLED or not hasattr(gm, "meta"):
        return axis_options
    by_node = search_memo.graph_cache(gm, "axis_options", by_node={})["by_node"]

    def options(node: fx.Node):
        hint = node.meta.get("chunk_hint", 1)       # the one mark a rule reads that planning sets late
        hit = by_node.get(node.name)
        if hit is None or hit[0] is not node or hit[1] != hint:
            hit = by_node[node.name] = (node, hint, axis_options(node))
        return list(hit[2])
    return options


def producer(node: fx.Node) -> tuple[fx.Node, int | None]:
    """(node that decides the placement, output index) — follows getitem to its source."""
    if node.op == "call_function" and node.target is operator.getitem:
        src, idx = node.args
        return src, idx
    return node, None


def output_spec(strategy: Strategy, index: int | None):
    if index is None:
        return strategy.output
    return strategy.output[index]


def tensor_shape(node: fx.Node) -> tuple:
    return shape_of(node)
