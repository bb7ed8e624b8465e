"""Pipeline cut points: the traced graph as an ordered sequence of *units* (one per layer).

A unit is one ``container.<i>`` layer (``autopar.graph.layers``); the ops before the first
layer (embeddings) join the first unit and the ops after the last (final norm, head, loss)
join the last, so a model with ``L`` layers has ``L`` units and at most ``L`` stages.

Assignment (``assign_units``), walking the graph in order (a topological order):
    unit(v) = max(running, ordinal(layer(v)))  for a node inside a layer, then running = unit(v)
    unit(v) = running                          for a node outside every layer
    unit(getitem(x, i)) = unit(x)              (tuples never cross a cut)
The running maximum makes units non-decreasing along the graph order, so every value flows
from a unit to the same or a later one, and a cut between units ``c - 1`` and ``c`` is valid.
Placeholders (parameters, buffers, inputs) belong to no unit: every stage that uses one gets it.

A value *crosses* cut ``c`` when it is produced in a unit ``< c`` and used in a unit ``>= c``
(the graph output counts as the last unit); ``crossing_values`` lists them per cut.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch.fx as fx

from autopar.graph.layers import layer_of


@dataclass
class Unit:
    index: int
    name: str                                        # "blocks.3" (the layer it is built around)
    nodes: list[str] = field(default_factory=list)   # call_function nodes, graph order


def assign_units(gm: fx.GraphModule) -> tuple[list[Unit], dict[str, int]]:
    """Units in order and node name -> unit index (call_function nodes only)."""
    ordinal: dict[tuple[str, int], int] = {}
    for node in gm.graph.nodes:
        key = layer_of(node.meta.get("module_path", "")) if node.op == "call_function" else None
        if key is not None and key not in ordinal:
            ordinal[key] = len(ordinal)
    names = [f"{c}.{i}" for (c, i) in ordinal] or ["<model>"]
    units = [Unit(i, n) for i, n in enumerate(names)]
    unit_of: dict[str, int] = {}
    running = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem and node.args[0].name in unit_of:
            u = unit_of[node.args[0].name]
        else:
            key = layer_of(node.meta.get("module_path", ""))
            if key is not None:
                running = max(running, ordinal[key])
            u = running
        unit_of[node.name] = u
        units[u].nodes.append(node.name)
    return units, unit_of


def crossing_values(gm: fx.GraphModule, unit_of: dict[str, int], num_units: int) -> list[list[fx.Node]]:
    """Per cut ``c`` (1 .. num_units - 1; index 0 unused and empty): the values crossing it."""
    cuts: list[list[fx.Node]] = [[] for _ in range(num_units)]
    last = num_units - 1
    for node in gm.graph.nodes:
        if node.name not in unit_of or _is_tuple(node):
            continue
        src = unit_of[node.name]
        far = max((unit_of.get(u.name, last) if u.op != "output" else last for u in node.users), default=src)
        for c in range(src + 1, far + 1):
            cuts[c].append(node)
    return cuts


def _is_tuple(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (tuple, list))


def unit_of_module(units: list[Unit], gm: fx.GraphModule, module: str) -> int | None:
    """The first unit holding an op of ``module`` (or of a submodule of it); None if none does."""
    by_name = {n.name: n for n in gm.graph.nodes}
    for unit in units:
        for name in unit.nodes:
            path = by_name[name].meta.get("module_path", "")
            if path == module or path.startswith(module + "."):
                return unit.index
    return None
