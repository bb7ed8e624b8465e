"""Which graph nodes need gradients: parameters, and float values that depend on one.

Graph facts read by the sharding rules, the cost models and the solver alike.
"""
from __future__ import annotations

import weakref

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

_RG_CACHE: "weakref.WeakKeyDictionary[fx.Graph, tuple[int, frozenset]]" = weakref.WeakKeyDictionary()


def node_value(node: fx.Node):
    return node.meta.get("val")


def is_parameter(node: fx.Node) -> bool:
    """A graph input holding a trainable parameter (``get_attr`` of one, or a lifted
    placeholder whose fake value has ``requires_grad``)."""
    val = node_value(node)
    if node.op == "get_attr":
        owner = node.graph.owning_module
        try:
            attr = owner.get_parameter(node.target) if owner is not None else None
        except AttributeError:
            attr = None
        if attr is not None:
            return attr.requires_grad
        return isinstance(val, torch.Tensor) and val.requires_grad
    return node.op == "placeholder" and isinstance(val, torch.Tensor) and bool(val.requires_grad)


def is_float_value(v) -> bool:
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def grad_nodes(graph: fx.Graph) -> frozenset:
    """Nodes whose value needs a gradient: parameters and float values depending on one."""
    cached = _RG_CACHE.get(graph)
    if cached is not None and cached[0] == len(graph.nodes):
        return cached[1]
    need: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            if is_parameter(node):
                need.add(node)
        elif node.op == "call_function":
            val = node_value(node)
            floats = any(is_float_value(v) for v in tree_flatten(val)[0]) if val is not None else True
            if floats and any(a in need for a in node.all_input_nodes):
                need.add(node)
    result = frozenset(need)
    _RG_CACHE[graph] = (len(graph.nodes), result)
    return result
