"""Op-rule registry: aten op -> per-axis candidate strategies.

``@register_rule(aten.mm.default)`` on a function ``rule(node) -> list[AxisStrategy]``.
An op without a rule runs replicated (always correct, maybe slow); ``unknown_ops`` lists them.
"""
from __future__ import annotations

import operator
from typing import Callable

import torch.fx as fx

from autopar.sharding.strategy import AxisStrategy

_RULES: dict[object, Callable[[fx.Node], list[AxisStrategy]]] = {}

# ops that do nothing a per-rank program needs (shape/dtype assertions on the global tensor)
DROPPED_OPS: set = set()


def register_rule(*targets):
    def deco(fn):
        for t in targets:
            _RULES[t] = fn
        return fn
    return deco


def rule_for(target) -> Callable[[fx.Node], list[AxisStrategy]] | None:
    """The rule registered for ``target``; rules register when ``autopar.sharding.rules`` is imported."""
    return _RULES.get(target)


def is_passthrough(node: fx.Node) -> bool:
    """getitem on a multi-output op: takes its producer's placement, no strategy of its own."""
    return node.op == "call_function" and node.target is operator.getitem
