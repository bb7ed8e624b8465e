"""Partial recomputation: "full" on ``k`` of a model's ``L`` repeated layers, the others kept.

Which layers (``spread``): layer ``i`` (graph order) recomputes when ``ceil((i+1) k / L) > ceil(i k / L)``,
``k`` layers spread evenly from the first, so each block of ``L / k`` consecutive layers recomputes its
first. A pipeline cuts the layers into contiguous stages, so with stages of equal layer counts and ``k``
a multiple of ``pp`` each stage recomputes ``k / pp`` of its layers, spread over the stage: the count
(so the memory and time) of Megatron's ``--recompute-granularity full --recompute-method block
--recompute-num-layers k/pp``, which takes each stage's first ``k / pp``. ``k = 0`` is "none", ``k = L`` is "full".
The result is a ``{layer: "full"}`` mapping, the per-layer form every consumer of
``plan.memory_options.recompute`` already reads.
"""
from __future__ import annotations

from .recompute_regions import layer_names


def spread(names: list[str], k: int) -> dict[str, str]:
    """``{layer: "full"}`` for ``k`` of ``names`` (module docstring); ValueError outside ``0..len(names)``."""
    n = len(names)
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= n:
        raise ValueError(f"recompute_layers={k!r} must be an int from 0 to the model's {n} repeated layers")
    return {name: "full" for i, name in enumerate(names) if -(-(i + 1) * k // n) > -(-i * k // n)}


def layers_choice(gm, k: int) -> dict[str, str]:
    """``spread`` over the repeated layers of a traced graph, in graph order."""
    return spread(layer_names(gm), k)


def recomputed_count(recompute) -> int | None:
    """How many layers a per-layer mapping recomputes "full" (None for a single choice)."""
    if not isinstance(recompute, dict):
        return None
    return sum(v == "full" for v in recompute.values())


def recompute_label(recompute) -> str:
    """A recompute choice for messages: the choice, or "full on 96 layers" for a per-layer mapping."""
    if not isinstance(recompute, dict):
        return str(recompute)
    used = sorted({v for v in recompute.values() if v != "none"})
    n = sum(v != "none" for v in recompute.values())
    return ("/".join(used) or "none") + f" on {n} layer{'s' if n != 1 else ''}"
