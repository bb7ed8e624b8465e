"""Steering the whole model's layout of a pipeline candidate between memory budgets: how much to tighten
(``_tighter``, ``_next_share``), how many microbatches its activations count for (``in_flight_weight``),
and what to try between an infeasible budget and a fitted one (``between_shares``).

``plan_pipeline`` solves the whole model's layout on the sub-mesh under a share of pp x the cap and
tightens that share while no stage cut fits (``_tighter``). When a tightened budget is infeasible,
falling back to a layout solved without a budget keeps every weight whole: the largest layout, which
fits no cut either. ``between_shares`` names the budgets to try instead, between the infeasible one
and the last budget a layout fitted: just above the least memory the solver proved (its memory row,
``InfeasibleError.least_memory``; ``LEAST_ROOM`` leaves room for what the row does not hold: the
backward transients), then the midpoint.
"""
from __future__ import annotations

from autopar.solver.inter_op import StageMemoryError

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


def _tighter(errors: list, room: float) -> float | None:
    """The factor to shrink the whole model's budget by when no partition fits for memory, or None.

    The layout is solved for the whole model under pp x the cap, which only bounds the average stage:
    a loose budget lets the solver keep weights whole for speed, and then the fullest stage is over
    the cap at every cut. ``room``: the cap less what
    a stage holds beyond its units. The factor is 0.9 room / need, ``need`` the fullest stage of the
    least-peak cut (``StageMemoryError``); None when no error was for memory or the cut already fits."""
    needs = [e.state + e.activations for e in errors if isinstance(e, StageMemoryError)]
    if not needs or room <= 0 or min(needs) <= room:
        return None
    return 0.9 * room / min(needs)


def in_flight_weight(kinds: list[str], pp: int, counts: list[int], batch: int, rows: int) -> float:
    """How many microbatches of ``rows`` the whole model's layout counts activations for: the fewest
    rows any count's fullest stage holds in flight (1F1B: min(pp, m) microbatches of batch / m;
    GPipe: all m), over ``rows``, at least 1. Under an even cut a stage holds 1 / pp of the state
    and of those activations, so the budget pp x the cap then bounds the fullest stage, not the
    average one (counted once, the activations are too small beside the state for any budget to
    trade them, while a stage holds many microbatches in flight)."""
    per_count = (min(pp, m) if kinds != ["gpipe"] else m for m in counts)
    least = min(f * (batch // m) for f, m in zip(per_count, counts))
    return max(1.0, least / rows)


def _next_share(share: float, tighter: float, whole: float, total: float) -> float:
    """The share of ``total`` (pp x the cap) the whole model's layout is solved under next: ``tighter``
    times the smaller of the last budget's share and what the last layout held (``whole`` bytes), so
    the next budget binds it: scaling the budget alone leaves a layout far under it unchanged
    (docs/solver.md, Inter-op)."""
    return tighter * min(share, whole / total)
