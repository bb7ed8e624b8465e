"""Activation-recomputation regions: which nodes of a graph one recompute choice re-runs.

Shared by the cost side (``cost_models/recompute.py``: the seconds a region adds and the saved
bytes it removes) and the lowering (``passes/recompute.py``: the region becomes one checkpointed
submodule), so both see the same nodes. Works on the traced graph and on a per-rank (or
pipeline-stage) graph: nodes are assigned to layers by their ``module_path`` metadata, the same
``container.<index>`` names :func:`autopar.graph.layers.find_layers` gives.

Choices per layer (``plan.memory_options.recompute_for(layer)``):

* ``"full"``: the layer's nodes, plus the nodes the passes inserted between them (collectives,
  local implementations: no ``module_path``), from the layer's first node to its last. Only the
  region's inputs (the layer input, parameters, anything computed before) stay saved.
* ``"selective"`` (Megatron's selective recomputation): the attention core only, each
  ``scaled_dot_product_attention`` node alone, or for attention built from ops the nodes on a
  path from ``Q @ K^T`` (the nearest matmul above a softmax) to ``P @ V`` (the nearest matmul
  below it), masking, scaling and dropout included. Its saved tensors (the ``B*heads*T^2``
  softmax output, dropout mask and dropped probabilities) are dropped.
* ``"except_attention"``: the whole layer except its attention cores (torchtitan's op-level
  selective checkpointing keeps the attention output the same way): the nodes of "full" minus the
  cores of "selective", as one region per part (the nodes before the first core, those between two,
  those after the last). The cores run once: their saved tensors (with SDPA: q, k, v, output and
  logsumexp; with context parallelism also the gathered K/V) stay, and the core's forward is not
  replayed in backward. At long sequences, where attention is most of a layer's forward, this keeps
  most of "full"'s memory saving for a fraction of its time. A layer without an attention core
  recomputes as "full".

A region is made *convex* (every node on a path between two of its nodes is added) so it can run
as one call, and a multi-output node brings its ``getitem`` users with it.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .layers import layer_of

aten = torch.ops.aten

CHOICES = ("none", "selective", "except_attention", "full")

SDPA_OPS = frozenset({
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
})
# per-rank graphs: an attention node under context parallelism runs as one of these functions
# (``collectives/local_ops.IMPLS``); they are cores as the op they replace
CP_ATTENTION = frozenset({"attention_gather", "attention_ring"})
_SOFTMAX = frozenset({aten.softmax.int, aten._softmax.default, aten._safe_softmax.default})
_MATMUL = frozenset({aten.matmul.default, aten.bmm.default, aten.mm.default, aten.baddbmm.default,
                     aten.einsum.default})


@dataclass
class Region:
    """One checkpointed region: ``name`` is the submodule the pass makes (``recompute_blocks_0``)."""

    name: str
    layer: str
    kind: str                                        # "full" | "selective" | "except_attention"
    nodes: list[str] = field(default_factory=list)   # graph order


def _graph(gm) -> fx.Graph:
    return gm.graph if isinstance(gm, fx.GraphModule) else gm


def node_layer(node: fx.Node) -> str | None:
    """``container.index`` of the layer a node belongs to (None: outside every layer)."""
    key = layer_of(node.meta.get("module_path", ""))
    return f"{key[0]}.{key[1]}" if key else None


def layer_names(gm) -> list[str]:
    """The layers of a graph, in graph order."""
    seen: dict[str, None] = {}
    for node in _graph(gm).nodes:
        if node.op == "call_function":
            name = node_layer(node)
            if name is not None:
                seen.setdefault(name)
    return list(seen)


def choices_for(gm, recompute: str | dict) -> dict[str, str]:
    """Layer -> "full"/"selective" for every layer of ``gm`` that recomputes (``recompute`` is
    one choice for every layer or a {layer: choice} mapping). Names the mapping has that ``gm``
    does not are ignored here (see :func:`unknown_layers`)."""
    names = layer_names(gm)
    if isinstance(recompute, dict):
        out = {n: recompute.get(n, "none") for n in names}
    else:
        out = {n: recompute for n in names}
    for n, c in out.items():
        if c not in CHOICES:
            raise ValueError(f"recompute choice {c!r} for layer {n!r} is not one of {', '.join(CHOICES)}")
    return {n: c for n, c in out.items() if c != "none"}


def unknown_layers(gm, recompute: str | dict) -> list[str]:
    """Names in a {layer: choice} mapping that are not layers of ``gm`` (sorted)."""
    if not isinstance(recompute, dict):
        return []
    have = set(layer_names(gm))
    return sorted(n for n in recompute if n not in have)


def _convex(nodes: list[fx.Node], pos: dict[fx.Node, int], members: set[fx.Node]) -> set[fx.Node]:
    """``members`` plus every node on a path between two of them, and the ``getitem`` users of a
    multi-output member. ``nodes``: the graph's nodes in order, ``pos`` their positions; a path
    between two members runs inside the span from the first member to the last (graph order is
    topological), so only that span is walked."""
    first, last = min(pos[m] for m in members), max(pos[m] for m in members)
    span = nodes[first:last + 1]
    after: set[fx.Node] = set()     # reachable from a member
    for n in span:
        if n not in members and any(a in members or a in after for a in n.all_input_nodes):
            after.add(n)
    before: set[fx.Node] = set()    # reaches a member
    for n in reversed(span):
        if n not in members and any(u in members or u in before for u in n.users):
            before.add(n)
    out = set(members) | (after & before)
    for n in list(out):
        if isinstance(n.meta.get("val"), (tuple, list)):
            out |= {u for u in n.users if u.op == "call_function" and u.target is operator.getitem}
    return {n for n in out if n.op == "call_function"}


def _nearest(start: fx.Node, targets: frozenset, up: bool, allowed: set[fx.Node]) -> fx.Node | None:
    """Breadth-first from ``start`` over inputs (``up``) or users, within ``allowed``."""
    frontier, seen = [start], {start}
    while frontier:
        nxt = []
        for n in frontier:
            for m in (n.all_input_nodes if up else n.users):
                if m in seen or m not in allowed:
                    continue
                if m.op == "call_function" and m.target in targets:
                    return m
                seen.add(m)
                nxt.append(m)
        frontier = nxt
    return None


def _attention_cores(nodes: list[fx.Node], pos: dict, layer_nodes: list[fx.Node]) -> list[set[fx.Node]]:
    allowed = set(layer_nodes)
    cores: list[set[fx.Node]] = []
    covered: set[fx.Node] = set()
    for n in layer_nodes:
        if n in covered or n.op != "call_function":
            continue
        if n.target in SDPA_OPS or getattr(n.target, "__name__", None) in CP_ATTENTION:
            core = _convex(nodes, pos, {n})
        elif n.target in _SOFTMAX:
            qk = _nearest(n, _MATMUL, True, allowed)
            av = _nearest(n, _MATMUL, False, allowed)
            if qk is None or av is None:
                continue
            core = _convex(nodes, pos, {qk, n, av})
        else:
            continue
        cores.append(core)
        covered |= core
    return cores


def _around_cores(nodes: list[fx.Node], pos: dict, span: list[fx.Node], members: set[fx.Node]) -> list[set[fx.Node]]:
    """``members`` (a layer's convex "full" region) without its attention cores, grouped by the set
    of cores each node descends from: the part before the first core, between cores, after the last.
    Each part is convex: along a path the set of cores above a node only grows, so a path between two
    nodes of one part neither passes through a core (its own set would then hold that core) nor leaves
    the part. No core: the whole region, one part."""
    cores = [c & members for c in _attention_cores(nodes, pos, span)]
    cores = [c for c in cores if c]
    if not cores:
        return [members] if members else []
    core_of = {n: i for i, c in enumerate(cores) for n in c}
    above: dict[fx.Node, frozenset] = {}
    for n in sorted(members, key=pos.__getitem__):
        mine: set[int] = set()
        for a in n.all_input_nodes:
            if a in core_of:
                mine.add(core_of[a])
            mine |= above.get(a, frozenset())
        above[n] = frozenset(mine)
    parts: dict[frozenset, set[fx.Node]] = {}
    for n, key in above.items():
        if n not in core_of:
            parts.setdefault(key, set()).add(n)
    return sorted(parts.values(), key=lambda p: min(pos[n] for n in p))


def _layer_spans(nodes: list[fx.Node]) -> dict[str, list[fx.Node]]:
    """Per layer, its call nodes and the inserted ones (no ``module_path``) between its first and
    last, in graph order (one pass over the graph, not one per layer)."""
    calls = [n for n in nodes if n.op == "call_function"]
    layer = [node_layer(n) for n in calls]
    bounds: dict[str, list[int]] = {}
    for i, name in enumerate(layer):
        if name is not None:
            bounds.setdefault(name, [i, i])[1] = i
    return {name: [n for n, own in zip(calls[lo:hi + 1], layer[lo:hi + 1])
                   if own == name or not n.meta.get("module_path")]
            for name, (lo, hi) in bounds.items()}


def _ordered(pos: dict[fx.Node, int], members: set[fx.Node]) -> list[str]:
    return [n.name for n in sorted(members, key=pos.__getitem__)]


def find_regions(gm, choices: dict[str, str]) -> list[Region]:
    """The regions of ``choices`` (layer -> "full"/"selective"; see :func:`choices_for`), in
    graph order. Layers of ``choices`` that ``gm`` does not have get no region."""
    graph = _graph(gm)
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    spans = _layer_spans(nodes)
    regions: list[Region] = []
    taken: set[fx.Node] = set()
    for layer in spans:
        kind = choices.get(layer, "none")
        if kind == "none":
            continue
        span = spans[layer]
        base = "recompute_" + layer.replace(".", "_")
        if kind == "full":
            members = _convex(nodes, pos, set(span)) - taken
            if members:
                regions.append(Region(base, layer, kind, _ordered(pos, members)))
                taken |= members
        elif kind == "except_attention":
            members = _convex(nodes, pos, set(span)) - taken
            for i, part in enumerate(_around_cores(nodes, pos, span, members)):
                regions.append(Region(f"{base}_part_{i}", layer, kind, _ordered(pos, part)))
                taken |= part
        elif kind == "selective":
            cores = [c - taken for c in _attention_cores(nodes, pos, span)]
            cores = [c for c in cores if c]
            for i, core in enumerate(cores):
                suffix = "_attention" + (f"_{i}" if len(cores) > 1 else "")
                regions.append(Region(base + suffix, layer, kind, _ordered(pos, core)))
                taken |= core
        else:
            raise ValueError(f"recompute choice {kind!r} for layer {layer!r} is not one of {', '.join(CHOICES)}")
    order = {n.name: i for n, i in pos.items()}
    regions.sort(key=lambda r: order[r.nodes[0]])
    return regions
