"""Activation recomputation: what a recompute choice costs in time and saves in memory.

The regions are those of :mod:`autopar.graph.recompute_regions` (the lowering,
``passes/recompute.py``, checkpoints exactly these nodes). Notation, for a graph and its regions
``R_1..R_k``:

* ``S(n)``: the storages node ``n`` saves for backward (``save_rules.SAVE_RULES``: graph values, each
  storage once, and internal tensors such as dropout masks and the SDPA logsumexp; parameters
  are not activations);
* ``I(R)``: the non-parameter tensor inputs of region ``R`` (checkpoint keeps them, through
  ``_NoopSaveInputs``, to re-run ``R``);
* ``t_fwd(n)``: the forward seconds of node ``n`` (``compute.node_cost``, or ``node_seconds``).

Then::

    saved_before   = bytes( U_n S(n) )
    saved_after    = bytes( U_{n not in any R} S(n)  U  U_R I(R) )
    removed        = saved_before - saved_after
    extra_seconds  = sum_R sum_{n in R} t_fwd(n)       (R's forward runs again in backward)

``bytes(U ...)`` counts each storage once. For a "full" layer, ``removed`` is everything the layer
saves except its input (the residual stream); for "selective", the attention core's saved
tensors: with ops, ``softmax`` output, dropout mask and dropped probabilities (the
``B*heads*T^2`` terms) and the ``Q K^T`` scores where kept; with ``scaled_dot_product_attention``,
its output and logsumexp (``B*heads*T*(d+1)`` elements) — q, k, v stay as the region's inputs.

``extra_seconds`` is an upper bound by the region's tail: non-reentrant checkpointing stops the
recomputation after the last op whose saved tensors backward needs. Collectives inside a region
(tensor parallel, on per-rank graphs) run again too; their time is not in ``t_fwd`` and is for
the caller to add (``cost_models.comm``) when it prices a sharded region.

Per-layer figures (:func:`layer_options`) take one layer at a time; they add up to the whole
choice's when no storage is saved by two layers (a transformer's: only the residual stream
crosses layers, and it is kept either way).
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.core import search_memo
from autopar.graph.recompute_regions import CHOICES, Region, choices_for, find_regions, layer_names

from autopar.graph.grads import is_parameter

from .compute import node_cost
from .devices import DeviceSpec
from .memory import _param_keys, _saved_by_node, _storage


@dataclass(frozen=True)
class LayerRecompute:
    """One layer's recomputation: the seconds it adds and the saved bytes it removes."""

    layer: str
    kind: str
    extra_seconds: float
    saved_bytes_removed: int
    regions: tuple[str, ...] = ()


@dataclass(frozen=True)
class RecomputeCost:
    """A whole recompute choice on one graph (module docstring for the math)."""

    extra_seconds: float
    saved_bytes_removed: int
    saved_bytes_before: int
    saved_bytes_after: int
    layers: dict[str, LayerRecompute] = field(default_factory=dict)


def _graph(gm) -> fx.Graph:
    return gm.graph if isinstance(gm, fx.GraphModule) else gm


def _region_inputs(graph: fx.Graph, region: Region) -> list[fx.Node]:
    by_name = {n.name: n for n in graph.nodes}
    inside = {by_name[n] for n in region.nodes}
    out: list[fx.Node] = []
    for n in inside:
        for a in n.all_input_nodes:
            if a not in inside and a not in out and a.op != "get_attr" and not is_parameter(a) \
                    and isinstance(a.meta.get("val"), torch.Tensor):
                out.append(a)
    return out


def _saved_bytes(graph: fx.Graph, regions: list[Region], dropout_mask_bytes) -> tuple[int, int]:
    """(saved_before, saved_after) in bytes (module docstring)."""
    saved_by = _saved_by_node(graph, dropout_mask_bytes)
    params = _param_keys(graph)
    inside = {name for r in regions for name in r.nodes}
    before: dict = {}
    after: dict = {}
    for node, items in saved_by.items():
        for key, _, nbytes in items:
            before.setdefault(key, nbytes)
            if node.name not in inside:
                after.setdefault(key, nbytes)
    for r in regions:
        for a in _region_inputs(graph, r):
            key, nbytes = _storage(a)
            if key not in params:
                after.setdefault(key, nbytes)
    return sum(before.values()), sum(after.values())


def _default_seconds(device: DeviceSpec | None) -> Callable[[fx.Node], float]:
    if device is None:
        raise ValueError("recompute_cost needs a device (cost_models.devices) or node_seconds")
    return lambda node: node_cost(node, device).time_fwd


def recompute_cost(gm, recompute: str | dict, device: DeviceSpec | None = None, *,
                   dropout_mask_bytes: int | None = 1,
                   node_seconds: Callable[[fx.Node], float] | None = None) -> RecomputeCost:
    """Seconds added and saved-activation bytes removed by ``recompute`` (one choice for every
    layer, or {layer: choice}) on ``gm`` (the traced graph, or one rank's / one stage's graph).

    ``node_seconds(node)``: a node's forward seconds (default ``node_cost(node, device).time_fwd``;
    a solver passes its sharded per-node times). ``dropout_mask_bytes`` as in
    ``memory.saved_activations`` (None on CPU)."""
    graph = _graph(gm)
    seconds = node_seconds or _default_seconds(device)
    choices = choices_for(graph, recompute)
    regions = find_regions(graph, choices)
    before, after = _saved_bytes(graph, regions, dropout_mask_bytes)
    by_name = {n.name: n for n in graph.nodes}
    extra = sum(seconds(by_name[n]) for r in regions for n in r.nodes)
    layers = {}
    for layer, kind in choices.items():
        mine = [r for r in regions if r.layer == layer]
        b, a = _saved_bytes(graph, mine, dropout_mask_bytes)
        layers[layer] = LayerRecompute(layer, kind, sum(seconds(by_name[n]) for r in mine for n in r.nodes), b - a,
                                       tuple(r.name for r in mine))
    return RecomputeCost(extra, before - after, before, after, layers)


def layer_options(gm, device: DeviceSpec | None = None, *, dropout_mask_bytes: int | None = 1,
                  node_seconds: Callable[[fx.Node], float] | None = None) -> dict[str, dict[str, LayerRecompute]]:
    """For the solver's search: layer -> choice ("none", "selective", "full") -> its cost, one
    layer at a time (module docstring)."""
    graph = _graph(gm)
    seconds = node_seconds or _default_seconds(device)
    out: dict[str, dict[str, LayerRecompute]] = {}
    for layer in layer_names(graph):
        out[layer] = {}
        for kind in CHOICES:
            if kind == "none":
                out[layer][kind] = LayerRecompute(layer, kind, 0.0, 0)
                continue
            c = recompute_cost(graph, {layer: kind}, dropout_mask_bytes=dropout_mask_bytes, node_seconds=seconds)
            out[layer][kind] = c.layers[layer]
    return out


_KEPT: "weakref.WeakKeyDictionary[fx.Graph, tuple[int, dict]]" = weakref.WeakKeyDictionary()


def _kept(graph: fx.Graph, recompute: str | dict, dropout_mask_bytes: int | None):
    """(regions' node names, [(saving node, storage key, tensor name, bytes, internal)]): what stays
    saved under a recompute choice: nothing a node inside a region saves, plus each region's
    non-parameter inputs (charged to the input's node). Kept per graph (while its node count holds)."""
    if not search_memo.ENABLED:
        return _kept_now(graph, recompute, dropout_mask_bytes)
    size, memo = _KEPT.get(graph, (None, None))
    if size != len(graph.nodes):
        memo = {}
        _KEPT[graph] = (len(graph.nodes), memo)
    key = (tuple(sorted(recompute.items())) if isinstance(recompute, dict) else recompute, dropout_mask_bytes)
    if key not in memo:
        inside, kept = _kept_now(graph, recompute, dropout_mask_bytes)
        memo[key] = (inside, tuple(kept))
    return memo[key]


def _kept_now(graph: fx.Graph, recompute: str | dict, dropout_mask_bytes: int | None):
    regions = find_regions(graph, choices_for(graph, recompute)) if recompute not in (None, "none") else []
    inside = frozenset(name for r in regions for name in r.nodes)
    kept = [(node.name, key, name, nbytes, isinstance(key, tuple) and key[:1] == ("internal",))
            for node, items in _saved_by_node(graph, dropout_mask_bytes).items() if node.name not in inside
            for key, name, nbytes in items]
    params = _param_keys(graph)
    for r in regions:
        for a in _region_inputs(graph, r):
            key, nbytes = _storage(a)
            if key not in params:
                kept.append((a.name, key, a.name, nbytes, False))
    return inside, kept


def saved_bytes_after(gm, recompute: str | dict, dropout_mask_bytes: int | None = 1
                      ) -> tuple[dict[str, tuple[int, int]], frozenset[str]]:
    """``memory.saved_bytes_by_node`` under a recompute choice (``_kept``), each storage once, and
    the names of the nodes whose forward runs again."""
    inside, kept = _kept(_graph(gm), recompute, dropout_mask_bytes)
    out: dict[str, list[int]] = {}
    seen: set = set()
    for node_name, key, name, nbytes, internal in kept:
        if key not in seen:
            seen.add(key)
            out.setdefault(node_name if internal else name, [0, 0])[1 if internal else 0] += nbytes
    return {k: (v[0], v[1]) for k, v in out.items()}, inside


def saved_storages(gm, recompute: str | dict = "none", dropout_mask_bytes: int | None = 1):
    """(saving node, storage key, bytes, internal, tensor) for every tensor kept for backward under a
    recompute choice; the key is the same for every view of one storage (q, k, v split from one
    projection count once); ``tensor``: the node that makes a graph storage (it is split as that
    node's output, as ``saved_bytes_by_node`` charges it), the saving node for an internal one."""
    _, kept = _kept(_graph(gm), recompute, dropout_mask_bytes)
    return [(node_name, key, nbytes, internal, node_name if internal else name)
            for node_name, key, name, nbytes, internal in kept]

