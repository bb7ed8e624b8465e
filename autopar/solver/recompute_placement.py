"""Which layers a pipeline recomputes when only some are: where their stored activations weigh most.

A pipeline rank holds each of its stages' activations for as many microbatches as are in flight on
that stage at the rank's peak (``interleaved_memory.rank_charges``). With one stage per rank every
layer of a rank has the same charge, so only how many it recomputes matters (``recompute_layers.spread``
gives each stage its share). Interleaved 1F1B is not so: rank ``r``'s first model stage holds up to
``2p - 1 - 2r`` microbatches at its peak, its later ones ``p`` (31 against 16 at p = 16, v = 4, m = 32),
so a layer kept on the first stage costs up to twice what one kept on a later stage costs. Spreading
the recomputed layers evenly keeps some layers of the heavy first stages and recomputes light ones,
and the rank needs more recomputation to fit than it would with the heavy ones recomputed first.

``charged_layers``: ``k`` layers per pipeline rank (``k * pp`` in all), each rank taking its layers in
order of their stage's charge (heaviest first, then graph order), the layers cut into ``pp * v``
stages evenly as the stage-cut DP starts from (the DP may move a boundary by a layer; the charges
are a property of the stage, not of the cut). The search bisects over ``k`` as before
(``partial_recompute.partial_plans``).
"""
from __future__ import annotations

from autopar.solver.interleaved_memory import rank_charges


def charged_layers(names: list[str], k: int, pp: int, microbatches: int, schedule: str, v: int = 1) -> dict[str, str]:
    """``{layer: "full"}`` for ``k`` layers per pipeline rank (module docstring); ``names`` in graph order."""
    stages = pp * v
    charges = rank_charges(schedule, pp, microbatches, v)
    stage_of = [i * stages // len(names) for i in range(len(names))]
    out: dict[str, str] = {}
    for r in range(pp):
        mine = [i for i in range(len(names)) if stage_of[i] % pp == r]
        mine.sort(key=lambda i: (-charges[stage_of[i]], i))
        out.update({names[i]: "full" for i in mine[:k]})
    return {n: "full" for n in names if n in out}


__all__ = ["charged_layers"]
