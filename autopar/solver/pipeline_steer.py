"""Steering the whole model's layout of a pipeline candidate between memory budgets.

``plan_pipeline`` solves the whole model's layout on the sub-mesh under a share of pp x the cap and
tightens that share while no stage cut fits (``_tighter``). When a tightened budget is infeasible,
falling back to a layout solved without a budget keeps every weight whole: the largest layout, which
fits no cut either. ``between_shares`` names the budgets to try instead, between the infeasible one
and the last budget a layout fitted: just above the least memory the solver proved (its memory row,
``InfeasibleError.least_memory``; ``LEAST_ROOM`` leaves room for what the row does not hold: the
backward transients), then the midpoint.
"""
from __future__ import annotations

LEAST_ROOM = 1.15   # the least-memory budget's margin over the proven least (the row holds no transients)


def between_shares(failed: float, fitted: float | None, least: float | None, total: float) -> list[float]:
    """Shares of ``total`` (pp x the cap, bytes) to solve the whole model's layout under after the share
    ``failed`` was infeasible: each strictly between ``failed`` and ``fitted`` (the share of the last budget
    a layout fitted; None: none did, nothing to try), the least-memory one first, then the midpoint."""
    if fitted is None or fitted <= failed or total <= 0:
        return []
    out = []
    if least is not None and failed < least * LEAST_ROOM / total < fitted:
        out.append(least * LEAST_ROOM / total)
    mid = (failed + fitted) / 2
    if all(abs(mid - s) > 1e-3 * fitted for s in out):
        out.append(mid)
    return out
