"""Price searches over a memory price lam (s/GiB) for the budgeted intra-op problem.

Both work on ``at(lam) -> (lower, choice, objective, memory_gib)``: the unbudgeted problem with
every byte priced at lam, solved (``lower``: a proven lower bound on its priced optimum, -inf when
none), its choice's unpriced objective and memory. ``intra_op`` builds ``at``; these only decide which prices to try.

``priced_search`` (the Lagrangian path): lam from 1e-6 x 8 until the priced optimum fits
``budget``, then ``steps`` geometric bisections between the last price that did not fit and the
smallest that did; the fitting choice of least objective (None when no price up to ``ceiling``
fits).

``dual_bound`` (the Bound of ``intra_op``): L(lam) = P(lam) - lam budget, P(lam) a proven lower bound
on the priced optimum (the optimum itself, or CP-SAT's objective bound of a solve out of time), is
a lower bound on the budgeted optimum; lam from a start price x 8 until the priced optimum fits,
then ``bisections`` bisections, stopping once the best L reaches ``cutoff``.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import NamedTuple

At = Callable[[float], tuple]
RAISES = 12         # x8 steps of the dual's price before it gives up on making the priced optimum fit


def priced_search(budget_gib: float, at: At, ceiling: float, deadline: float, steps: int) -> tuple | None:
    """(objective, choice, memory GiB) of the fitting priced optimum of least objective, or None."""
    lo, hi, best = 0.0, None, None
    price = 1e-6
    while price <= ceiling:
        _, choice, objective, memory = at(price)
        if memory <= budget_gib:
            hi, best = price, (objective, choice, memory)
            break
        lo, price = price, price * 8
    if best is None:
        return None
    for _ in range(steps):
        if time.perf_counter() > deadline:
            break
        mid = math.sqrt(lo * hi) if lo > 0 else hi / 8
        _, choice, objective, memory = at(mid)
        if memory <= budget_gib:
            hi = mid
            if objective < best[0]:
                best = (objective, choice, memory)
        else:
            lo = mid
    return best


class Dual(NamedTuple):
    """``dual_bound``'s answer: the bound, and the fitting priced choice of least objective seen
    (None: no price tried made it fit), a good start for the budgeted solve."""

    bound: float
    fit: list[int] | None = None
    fit_objective: float = math.inf


def dual_bound(budget_gib: float, at: At, cutoff: float, deadline: float, bisections: int = 4,
               stop: tuple[type[Exception], ...] = (), start: float = 1e-4, floor: float = 0.0) -> Dual:
    """max over the prices tried of L(lam) = (a proven lower bound on the priced optimum) - lam *
    budget (-inf when none was proven). A priced solve raising one of ``stop`` (out of time) ends
    the search with the bound so far: every L(lam) already proven stays a lower bound. The search
    runs up by x8 from ``start`` until the priced optimum fits, then bisects between the last
    price that did not fit (or ``floor``, under which the caller knows no L reaches ``cutoff``)
    and the first that did; with neither, it stops at the first."""
    best = [-math.inf]
    fit: list = [None, math.inf]

    def fits(price: float) -> bool:
        lower, choice, objective, memory = at(price)
        best[0] = max(best[0], lower - price * budget_gib)
        if memory <= budget_gib and objective < fit[1]:
            fit[:] = [choice, objective]
        return memory <= budget_gib

    lo, hi, price = floor, None, start
    try:
        for _ in range(RAISES):
            if time.perf_counter() >= deadline or best[0] >= cutoff:
                break
            if fits(price):
                hi = price
                break
            lo, price = price, price * 8
        for _ in range(bisections if hi is not None and lo > 0 else 0):
            if time.perf_counter() > deadline or best[0] >= cutoff:
                break
            mid = math.sqrt(lo * hi)
            if fits(mid):
                hi = mid
            else:
                lo = mid
    except stop:
        pass
    return Dual(best[0], fit[0], fit[1])
