"""Activation recomputation: the plan's chosen layers run under ``torch.utils.checkpoint``.

Input: one rank's graph (after ``insert_collectives`` / ``localize_shapes``, or one pipeline
stage's graph after ``split_stages``) and ``plan.memory_options.recompute``. Each region of
``graph/recompute_regions.find_regions`` (a whole layer for "full", the attention core for
"selective") is moved into its own GraphModule and called through a :class:`Recompute`
submodule named after it, so ``pmodel.code`` reads::

    recompute_blocks_0 = self.recompute_blocks_0(add, p_blocks_0_ln1_weight, ...)
    getitem_9 = recompute_blocks_0[0]

Semantics (``checkpoint(..., use_reentrant=False)``): the region's forward runs without saving
its intermediate tensors; only its inputs are kept (``_NoopSaveInputs``). In backward, the first
time a gradient needs one of them the region's forward runs again:

* RNG: the CPU (and the inputs' device) RNG state is stashed before the forward and restored for
  the recomputation (``preserve_rng_state=True``), so dropout draws the same masks.
* Collectives inside a region (tensor-parallel all-reduces, gathers) run again in backward. Every
  rank runs the same program, and autograd visits the same nodes in the same order on every
  rank, so the recomputed collectives match across ranks. The axes bound during the forward
  (``collectives.groups.bound_axes``) are re-bound for the recomputation, and
  ``count_collectives`` records the re-run ones with phase "recompute".
* Under ``torch.no_grad()`` (forward-only, evaluation) a region just runs.
"""
from __future__ import annotations

import heapq
import operator

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from autopar.collectives.comm import COUNTER
from autopar.collectives.groups import bound_axes, current_axes
from autopar.graph.recompute_regions import Region, choices_for, find_regions, layer_names, unknown_layers
from autopar.plan.plan import PlanError


class _Run:
    """The region's body with the forward's mesh axes bound (also when autograd recomputes it)."""

    def __init__(self, body: fx.GraphModule, axes):
        self.body, self.axes = body, axes
        self.runs = 0

    def __call__(self, *args):
        self.runs += 1
        if self.runs == 1:
            return self._body(args)
        previous, COUNTER.phase_override = COUNTER.phase_override, "recompute"   # counted apart from the forward
        try:
            return self._body(args)
        finally:
            COUNTER.phase_override = previous

    def _body(self, args):
        if self.axes is None:
            return self.body(*args)
        with bound_axes(self.axes):
            return self.body(*args)


class Recompute(nn.Module):
    """One recomputed region (``kind`` "full" or "selective" of ``layer``); returns a tuple."""

    def __init__(self, body: fx.GraphModule, layer: str, kind: str):
        super().__init__()
        self.body = body
        self.layer, self.kind = layer, kind

    def forward(self, *args):
        if not torch.is_grad_enabled():
            return self.body(*args)
        return checkpoint(_Run(self.body, current_axes()), *args, use_reentrant=False, preserve_rng_state=True)

    def extra_repr(self) -> str:
        return f"layer={self.layer!r}, kind={self.kind!r}"


def recompute_choices(gm: fx.GraphModule, recompute) -> dict[str, str]:
    """Layer -> "full"/"selective" of ``recompute`` (``plan.memory_options.recompute``) for the
    layers of ``gm``; a mapping that names a layer ``gm`` lacks is a PlanError naming it."""
    bad = unknown_layers(gm, recompute)
    if bad:
        have = layer_names(gm)
        raise PlanError(f"memory_options.recompute names {', '.join(repr(b) for b in bad)}, which "
                        f"{'is not a layer' if len(bad) == 1 else 'are not layers'} of this model; its layers are: "
                        f"{', '.join(have) if have else '(none: no repeated container.<index> modules)'}")
    try:
        return choices_for(gm, recompute)
    except ValueError as e:
        raise PlanError(str(e)) from None


def _stable_toposort(graph: fx.Graph) -> None:
    """Reorder nodes so every input comes first, keeping the current order where it already does."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    if all(index[a] < index[n] for n in nodes for a in n.all_input_nodes):
        return
    waiting = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [index[n] for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        n = nodes[heapq.heappop(ready)]
        order.append(n)
        for u in n.users:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, index[u])
    if len(order) != len(nodes):
        raise RuntimeError("recompute: the graph has a cycle after extracting a region")
    out = next(n for n in order if n.op == "output")
    order.remove(out)
    order.append(out)
    prev = order[0]
    if prev is not nodes[0]:
        nodes[0].prepend(prev)
    for n in order[1:]:
        prev.append(n)
        prev = n


def _extract(gm: fx.GraphModule, region: Region) -> None:
    graph = gm.graph
    by_name = {n.name: n for n in graph.nodes}
    members = [by_name[n] for n in region.nodes]
    inside = set(members)
    inputs: list[fx.Node] = []
    attrs: list[fx.Node] = []
    for n in members:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs and a not in attrs:
                (attrs if a.op == "get_attr" else inputs).append(a)
    outputs = [n for n in members if any(u not in inside for u in n.users)]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for a in attrs:
        env[a] = sub.node_copy(a)
    for n in members:
        env[n] = sub.node_copy(n, lambda x: env[x])
    sub.output(tuple(env[o] for o in outputs))
    body = fx.GraphModule(gm, sub, class_name=region.name)
    gm.add_submodule(region.name, Recompute(body, region.layer, region.kind))
    with graph.inserting_after(members[-1]):
        call = graph.call_module(region.name, tuple(inputs))
    call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
    call.meta["recompute"] = region.kind
    prev = call
    for i, o in enumerate(outputs):
        with graph.inserting_after(prev):
            item = graph.call_function(operator.getitem, (call, i))
        item.meta = dict(o.meta)
        for u in [u for u in o.users if u not in inside]:
            u.replace_input_with(o, item)
        prev = item
    for n in reversed(members):
        graph.erase_node(n)
    _stable_toposort(graph)


def apply_recompute(gm: fx.GraphModule, choices: dict[str, str]) -> list[Region]:
    """Replace each region of ``choices`` (layer -> "full"/"selective", from
    :func:`recompute_choices`) in ``gm`` by a checkpointed submodule call, in place; returns the
    regions (layers ``gm`` does not hold, e.g. on another pipeline stage, are skipped)."""
    if not choices:
        return []
    regions = find_regions(gm, choices)
    for region in regions:
        _extract(gm, region)
    gm.graph.lint()
    gm.recompile()
    return regions
