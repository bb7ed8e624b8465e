"""The embedding and the head as pipeline units of their own (``graph.cut_points.assign_units``
with ``ends=True``): where the stage-cut DP may cut at them, and how a stage names them.

The pipeline search costs ``L + 2`` units (the end units where worth a cut) and keeps each end
with its layer (``CutRules.joined``) unless an interleaved schedule's ``pp x v`` model stages
outnumber the ``L`` layers: then every unit may be a model stage of its own (Llama 3 405B's 126
layers at pp 16 x v 8: the embedding, 126 layers and the head are 128 chunks). A partition over the
units with the ends joined is exactly one over the ``L`` layer units, so every other plan is the
one the layers alone give.
"""
from __future__ import annotations

from dataclasses import replace

from autopar.graph.cut_points import Unit
from autopar.solver.inter_op import CutRules
from autopar.solver.virtual_stages import INTERLEAVED


def rules_at(rules: CutRules, schedule: str, pp: int, v: int | None, num_units: int) -> CutRules:
    """``rules`` with the end cuts free when ``schedule`` at ``v`` needs more model stages than layers."""
    layers = num_units - len(set(rules.joined))
    if rules.joined and schedule == INTERLEAVED and v is not None and pp * v > layers:
        return replace(rules, joined=())
    return rules


def stage_layer_names(units: list[Unit]) -> list[str]:
    """A stage's layers as the plan lists them: its repeated layers; an end unit alone by its name."""
    return [u.name for u in units if u.is_layer] or [u.name for u in units]


__all__ = ["rules_at", "stage_layer_names"]
