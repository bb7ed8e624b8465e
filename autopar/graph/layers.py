"""Repeated layers: nodes grouped by ``container.<index>`` module paths and matched by a
structural hash, so the solver ties layer k's choices to layer 0's (solve once, reuse)."""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx

_LAYER = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


@dataclass
class Layer:
    container: str
    index: int
    nodes: list[str] = field(default_factory=list)
    params: list[str] = field(default_factory=list)    # placeholder names
    signature: str = ""

    @property
    def name(self) -> str:
        return f"{self.container}.{self.index}"


def layer_of(path: str) -> tuple[str, int] | None:
    m = _LAYER.match(path or "")
    return (m.group(1), int(m.group(2))) if m else None


def _shape(v):
    return tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__


def _node_sig(node: fx.Node) -> str:
    """Target, output shape and arguments, every graph value (also inside lists, e.g. ``cat``'s
    tensors) by its shape, never its name."""
    args = fx.node.map_arg(node.args, lambda a: ("%", _shape(a.meta.get("val"))))
    kwargs = fx.node.map_arg(node.kwargs, lambda a: ("%", _shape(a.meta.get("val"))))
    return f"{node.target}|{_shape(node.meta.get('val'))}|{args}|{sorted(kwargs.items())}"


def find_layers(gm: fx.GraphModule, param_names: dict[str, str]) -> list[Layer]:
    """Layers in graph order. ``param_names``: placeholder -> parameter/buffer name."""
    layers: dict[tuple[str, int], Layer] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        key = layer_of(node.meta.get("module_path", ""))
        if key:
            layers.setdefault(key, Layer(*key)).nodes.append(node.name)
    for ph, pname in param_names.items():
        key = layer_of(pname)
        if key and key in layers:
            layers[key].params.append(ph)
    by_name = {n.name: n for n in gm.graph.nodes}
    for layer in layers.values():
        prefix = f"{layer.container}.{layer.index}."
        rel = sorted((param_names[p][len(prefix):], _shape(by_name[p].meta.get("val"))) for p in layer.params)
        h = hashlib.sha1()
        for n in layer.nodes:
            h.update(_node_sig(by_name[n]).encode())
        h.update(repr(rel).encode())
        layer.signature = h.hexdigest()
        layer.params.sort(key=lambda p: param_names[p])
    return list(layers.values())


def tie_groups(layers: list[Layer]) -> list[list[str]]:
    """Groups of node/placeholder names that must pick the same strategy (position-wise)."""
    groups: dict[tuple[str, str], list[Layer]] = {}
    for layer in layers:
        groups.setdefault((layer.container, layer.signature), []).append(layer)
    ties = []
    for same in groups.values():
        if len(same) < 2:
            continue
        first = same[0]
        for pos in range(len(first.nodes)):
            ties.append([layer.nodes[pos] for layer in same])
        for pos in range(len(first.params)):
            ties.append([layer.params[pos] for layer in same])
    return ties
