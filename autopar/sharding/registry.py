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


def has_rule(target) -> bool:
    _load()
    return target in _RULES


def axis_options(node: fx.Node) -> list[AxisStrategy]:
    """Candidate strategies of ``node`` along one mesh axis ([] = replicate only)."""
    _load()
    rule = _RULES.get(node.target)
    return rule(node) if rule else []


def is_passthrough(node: fx.Node) -> bool:
    """getitem on a multi-output op: takes its producer's placement, no strategy of its own."""
    return node.op == "call_function" and node.target is operator.getitem


_loaded = False


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        from autopar.sharding import rules  # noqa: F401  (registers every op family)
