"""The Plan's renderers, registered from above: the Plan is plain data and imports none of them.

``autopar.report`` registers its views when imported (``import autopar`` imports it), so
``plan.report()`` works wherever a Plan exists, and the Plan never imports its renderers.
"""
from __future__ import annotations

from typing import Callable

_VIEWS: dict[str, Callable] = {}


def register_view(name: str):
    """Decorator: ``fn`` renders ``plan.<name>(...)``."""
    def deco(fn: Callable) -> Callable:
        _VIEWS[name] = fn
        return fn
    return deco


def view(name: str) -> Callable:
    try:
        return _VIEWS[name]
    except KeyError:
        raise RuntimeError(f"plan.{name}() needs autopar.report: import autopar (or autopar.report) first") from None
