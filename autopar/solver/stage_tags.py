"""Check ``pipeline_stage`` tags against the traced model's layers, once, before any pipeline is solved.

``pipeline_stage(layer, k)`` starts stage ``k`` at a whole layer (a unit of ``graph/cut_points.py``).
Tags ``(u_i, k_i)`` (layer index, stage), sorted by layer, with ``(0, 0)`` in front and ``(L, pp)``
behind, are valid when each tags a layer (or anything of the first layer with ``k = 0``), a stage
starts at one layer, and ``0 <= k_{i+1} - k_i <= u_{i+1} - u_i`` (stages increase along the
layers and each holds at least one). A violation is one PlanError that names the tags and the rule.
"""
from __future__ import annotations

from autopar.graph.cut_points import Unit, unit_of_module
from autopar.plan.plan import PlanError
from autopar.solver.annotations import LEFTOVER


def check_stage_tags(tags: dict[str, int], units: list[Unit], gm, pp: int) -> None:
    """Raise a PlanError for the first tag that breaks the rule (module docstring)."""
    names = [u.name for u in units]
    if names == ["<model>"]:
        module, k = next(iter(tags.items()))
        raise PlanError(f"pipeline_stage({module!r}, {k}): the traced model has no layers to cut between (modules "
                        "named like 'blocks.0', 'layers.1', e.g. in an nn.ModuleList); a pipeline splits between them")
    shown = ", ".join(names) if len(names) <= 5 else f"{', '.join(names[:3])}, ..., {names[-1]}"
    rule = (f"pipeline_stage(layer, k) starts stage k at a whole layer of the model ({shown}); stage numbers "
            "increase along the layers, stage 0 starts at the first layer, and every stage holds at least one layer")
    listed = "tags: " + ", ".join(f"{m!r} -> {k}" for m, k in tags.items())
    at: list[tuple[int, int, str]] = []
    for module, k in tags.items():
        u = unit_of_module(units, gm, module)
        if u is None:
            raise PlanError(f"pipeline_stage({module!r}, {k}): module {module!r} runs no op in the traced model (it "
                            f"is not called in forward, or the name is wrong); tag one of the layers ({shown}). "
                            f"{LEFTOVER}")
        if module != names[u] and not (u == 0 and k == 0):
            where = (f"is inside layer {names[u]!r}" if module.startswith(names[u] + ".")
                     else f"is not a layer (its ops run in layer {names[u]!r})")
            raise PlanError(f"pipeline_stage({module!r}, {k}): {module!r} {where}; tag the whole layer, e.g. "
                            f"pipeline_stage({names[u]!r}, {k}). Rule: {rule} ({listed})")
        at.append((u, k, module))
    at.sort()
    for (u, k, m), (_, k2, m2) in zip(at, at[1:]):
        if k2 < k:
            raise PlanError(f"pipeline_stage tags out of order: {m!r} starts stage {k} but {m2!r}, later in the "
                            f"model, is tagged stage {k2}. Rule: {rule} ({listed})")
    prev_u, prev_k, prev_m = 0, 0, None
    for u, k, m in at + [(len(units), pp, None)]:
        if m is not None and u == 0 and k > 0:
            raise PlanError(f"pipeline_stage({m!r}, {k}): {m!r} is the first layer, which always starts stage 0; "
                            f"tag a later layer to start stage {k}. Rule: {rule} ({listed})")
        if k == prev_k and k > 0 and u != prev_u:
            raise PlanError(f"pipeline_stage tags {prev_m!r} and {m!r} both start stage {k}: a stage starts at one "
                            f"layer; tag only the first layer of each stage. Rule: {rule} ({listed})")
        if k - prev_k > u - prev_u:
            start = "the first layer" if prev_m is None else repr(prev_m)
            end = f"before {m!r}" if m is not None else "to the end of the model"
            raise PlanError(f"pipeline_stage tags leave {k - prev_k} stage(s) ({prev_k} to {k - 1}) for the "
                            f"{u - prev_u} layer(s) from {start} {end}: every stage needs at least one layer "
                            f"({pp} stages in all). Rule: {rule} ({listed})")
        prev_u, prev_k, prev_m = u, k, m
