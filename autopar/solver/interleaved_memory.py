"""Per-rank memory of a pipeline whose ranks hold several model stages (interleaved 1F1B, ``v``
virtual stages per rank), as the stage-cut DP (``inter_op``) charges and checks it.

A rank's peak is the most activation bytes it holds at one moment of its action order, not the
sum of its stages' own peaks: under Megatron's interleaved order rank 0's stages peak at different
times, and the rank holds ``p + (p - 1) / v`` microbatches of its layers at once (Narayanan et al.,
SC'21, section 2.2; ``rank_charges`` reproduces it from the built schedule) where the sum of the
stage peaks charges ``2p - 2 + ...`` (6 at p = 4 for every v; 4.375 is right at v = 8).

* ``rank_charges``: per stage, the microbatches live on it at its rank's peak when every stage's
  activations are equal; the DP charges a stage ``state + charge x activations``, so a rank's
  charges sum to its exact peak for an even cut.
* ``rank_peaks``: the exact per-rank peak of a given cut (replaying each rank's order with its
  stages' own bytes); the DP's partitions are checked with it.
* ``stage_budgets``: the per-stage budgets a rank's budget is split into for the DP, which can
  only bound each stage on its own (a rank's sum is not additive along the cut): the loosest
  first (a stage may take what the rank's other stages leave at their least), then shares in
  proportion to an even cut's stage memory. ``inter_op.partition_stages`` keeps the first whose
  partition's ``rank_peaks`` fit, else the stage peaks each within budget / v (always valid).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from autopar.schedules.schedule import Schedule, build_schedule, in_flight


@functools.lru_cache(maxsize=4096)
def rank_charges(kind: str, pp: int, m: int, v: int = 1) -> tuple[int, ...]:
    """Per stage, the microbatches live on it when its rank holds the most microbatch-chunks (the first
    such moment of the rank's order). With one stage per rank, the stage's own peak (``in_flight``)."""
    if v == 1:
        return in_flight(kind, pp, m, 1)
    sched = build_schedule(kind, pp, m, v)
    charges = [0] * sched.num_stages
    for r, actions in enumerate(sched.actions):
        live = dict.fromkeys(range(r, sched.num_stages, pp), 0)
        total, best, at_best = 0, -1, dict(live)
        for a in actions:
            step = 1 if a.kind == "F" else -1
            live[a.stage] += step
            total += step
            if total > best:
                best, at_best = total, dict(live)
        for s, c in at_best.items():
            charges[s] = c
    return tuple(charges)


def rank_peaks(sched: Schedule, state: Sequence[float], acts: Sequence[float], after: Sequence[float]) -> list[float]:
    """Per rank: its stages' state plus the larger of the most activation bytes it holds at once over
    its action order (stage s holds ``acts[s]`` per live microbatch) and the bytes held after the
    schedule (``after``)."""
    out = []
    for r, actions in enumerate(sched.actions):
        mine = range(r, sched.num_stages, sched.num_ranks)
        held = peak = 0.0
        for a in actions:
            held += acts[a.stage] if a.kind == "F" else -acts[a.stage]
            peak = max(peak, held)
        out.append(sum(state[s] for s in mine) + max(peak, sum(after[s] for s in mine)))
    return out


def stage_budgets(pp: int, v: int, budget: float, least: np.ndarray, even: np.ndarray) -> list[np.ndarray]:
    """Per-stage budgets (stage s on rank s % pp) to try, loosest first. ``least[s]``: the least
    memory stage s can hold (one unit); ``even[s]``: its memory under an even cut. (1) budget minus
    the least the rank's other stages hold; (2) the budget in proportion to ``even`` over the
    rank's stages."""
    num = pp * v
    rank_of = np.arange(num) % pp
    least_sum = np.array([least[rank_of == r].sum() for r in range(pp)])
    loose = budget - (least_sum[rank_of] - least)
    even = np.maximum(even, 1e-30)
    even_sum = np.array([even[rank_of == r].sum() for r in range(pp)])
    return [loose, budget * even / even_sum[rank_of]]
