"""The keys of ``plan.degrees`` and how reports write them.

``dp``, ``tp``, ``pp`` are the data, tensor and pipeline split; ``ep`` the expert split (the product
of the mesh axes on which some MoE experts node keeps its experts split, ``solver/degrees.py``) and
``cp`` the context split (the product of the mesh axes on which some attention node runs its "cp"
strategy). ``ep`` and ``cp`` count axes that ``dp`` or ``tp`` count too (Megatron's convention:
expert parallelism subdivides the data-parallel ranks), so ``dp * tp * pp`` is still the mesh size
of a plan without idle axes. Every key is present, 1 where unused; a plan JSON written before a key
existed reads it as 1.
"""
from __future__ import annotations

DEGREE_KEYS = ("dp", "tp", "pp", "ep", "cp")
OPTIONAL_KEYS = ("ep", "cp")      # shown in reports only when > 1


def full_degrees(degrees: dict | None) -> dict:
    """``degrees`` with every key of ``DEGREE_KEYS`` (1 where missing), in that order; other keys kept after them."""
    d = dict(degrees or {})
    out = {k: int(d.pop(k, 1)) for k in DEGREE_KEYS}
    out.update(d)
    return out


def degrees_text(degrees: dict, sep: str = " ") -> str:
    """``dp=4 tp=1 pp=1`` (+ ``ep=4``, ``cp=2`` where > 1)."""
    d = full_degrees(degrees)
    return sep.join(f"{k}={v}" for k, v in d.items() if k not in OPTIONAL_KEYS or v > 1)
