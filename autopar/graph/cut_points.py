"""Pipeline cut points: the traced graph as an ordered sequence of *units* (one per layer).

A unit is one ``container.<i>`` layer (``autopar.graph.layers``); the ops before the first
layer (embeddings) join the first unit and the ops after the last (final norm, head, loss)
join the last, so a model with ``L`` layers has ``L`` units and at most ``L`` stages.

``assign_units(gm, ends=True)`` makes those two ends units of their own, ``EMBEDDING`` in front
and ``HEAD`` behind (``L + 2`` units, as Llama 3 balances its pipeline: "one Transformer layer
fewer on the first and last stages"), each where it is worth a cut: it uses a parameter, and
what crosses its cut is no more than what crosses the widest cut between two layers (the hidden
state, plus what every layer reads, e.g. rotary tables). The pipeline search cuts there only when
an interleaved schedule needs more model stages than there are layers (``CutRules.joined``).

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

from autopar.core import search_memo
from autopar.graph.grads import is_parameter
from autopar.graph.layers import layer_of

EMBEDDING, HEAD = "<embedding>", "<head>"      # the names of the end units (``ends=True``)


@dataclass
class Unit:
    index: int
    name: str                                        # "blocks.3" (the layer it is built around)
    nodes: list[str] = field(default_factory=list)   # call_function nodes, graph order

    @property
    def is_layer(self) -> bool:
        """A repeated layer's unit (not an end unit, not the whole layerless model)."""
        return self.name not in (EMBEDDING, HEAD, "<model>")


def assign_units(gm: fx.GraphModule, ends: bool = False) -> tuple[list[Unit], dict[str, int]]:
    """Units in order and node name -> unit index (call_function nodes only); ``ends``: the
    embedding and the head as units of their own where worth a cut (module docstring)."""
    cache = search_memo.graph_cache(gm, "assign_units") if search_memo.ENABLED else {}
    if ends not in cache:
        units, unit_of = _layer_units(gm)
        cache[ends] = split_ends(gm, units, unit_of) if ends and units[0].is_layer else (units, unit_of)
    units, unit_of = cache[ends]
    return [Unit(u.index, u.name, list(u.nodes)) for u in units], dict(unit_of)     # copies: callers may edit


def layer_count(units: list[Unit]) -> int:
    """How many of ``units`` are repeated layers (at least 1: a layerless model is one unit)."""
    return max(1, sum(u.is_layer for u in units))


def end_cuts(units: list[Unit]) -> tuple[int, ...]:
    """The cut points that separate an end unit from its layer (``CutRules.joined``)."""
    out = (1,) if units[0].name == EMBEDDING else ()
    return out + ((len(units) - 1,) if len(units) > 1 and units[-1].name == HEAD else ())


def _layer_units(gm: fx.GraphModule) -> tuple[list[Unit], dict[str, int]]:
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


def split_ends(gm: fx.GraphModule, units: list[Unit], unit_of: dict[str, int]) -> tuple[list[Unit], dict[str, int]]:
    """``units`` with the ops before the first layer's first op and after the last layer's last op
    (outside every layer) moved to units of their own, each where it is worth a cut (module docstring)."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    inside = [i for i, n in enumerate(calls) if layer_of(n.meta.get("module_path", "")) is not None]
    if not inside:
        return units, unit_of
    layers = len(units)
    pre = {n.name for n in calls[:inside[0]]}
    post = {n.name for n in calls[inside[-1] + 1:] if unit_of[n.name] == layers - 1}
    widths = _cut_bytes(gm, _shifted(calls, unit_of, pre, post, True, True), layers + 2)
    inner = max(widths[2:layers + 1], default=0.0)
    keep_pre = bool(pre) and _uses_parameter(gm, pre) and (layers < 2 or widths[1] <= inner)
    keep_post = bool(post) and _uses_parameter(gm, post) and (layers < 2 or widths[layers + 1] <= inner)
    if not (keep_pre or keep_post):
        return units, unit_of
    out = _shifted(calls, unit_of, pre, post, keep_pre, keep_post)
    names = ([EMBEDDING] if keep_pre else []) + [u.name for u in units] + ([HEAD] if keep_post else [])
    split = [Unit(i, n) for i, n in enumerate(names)]
    for node in calls:
        split[out[node.name]].nodes.append(node.name)
    return split, out


def _shifted(calls: list[fx.Node], unit_of: dict[str, int], pre: set[str], post: set[str], keep_pre: bool,
             keep_post: bool) -> dict[str, int]:
    """node -> unit with the kept ends split off (a ``getitem`` stays with its tuple)."""
    last = max(unit_of.values()) + int(keep_pre) + int(keep_post)
    out: dict[str, int] = {}
    for node in calls:
        if node.target is operator.getitem and node.args[0].name in out:
            out[node.name] = out[node.args[0].name]
        elif node.name in pre:
            out[node.name] = 0
        elif node.name in post:
            out[node.name] = last
        else:
            out[node.name] = unit_of[node.name] + int(keep_pre)
    return out


def _uses_parameter(gm: fx.GraphModule, names: set[str]) -> bool:
    return any(a.op in ("placeholder", "get_attr") and is_parameter(a)
               for n in gm.graph.nodes if n.name in names for a in n.all_input_nodes)


def _cut_bytes(gm: fx.GraphModule, unit_of: dict[str, int], num_units: int) -> list[float]:
    """Per cut, the bytes of the values crossing it (unsplit)."""
    out = []
    for values in crossing_values(gm, unit_of, num_units):
        out.append(float(sum(v.meta["val"].numel() * v.meta["val"].element_size() for v in values
                             if hasattr(v.meta.get("val"), "numel"))))
    return out


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
