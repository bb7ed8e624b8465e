"""Price searches over a memory price lam (s/GiB) for the budgeted intra-op problem.

Both work on ``at(lam) -> (proven, choice, objective, memory_gib)``: the unbudgeted problem with
every byte priced at lam, solved (``proven``: to optimality), its choice's unpriced objective and
memory. ``intra_op`` builds ``at``; these only decide which prices to try.

``priced_search`` (the Lagrangian path): lam from 1e-6 x 8 until the priced optimum fits
``budget``, then ``steps`` geometric bisections between the last price that did not fit and the
smallest that did; the fitting choice of least objective (None when no price up to ``ceiling``
fits).

``dual_bound`` (the Bound of ``intra_op``): L(lam) = objective + lam (memory - budget) of a proven
priced optimum is a lower bound on the budgeted optimum; lam from 1e-4 x 8 until the priced optimum
fits, then ``bisections`` bisections, stopping once the best L reaches ``cutoff``.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

At = Callable[[float], tuple]


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


def dual_bound(budget_gib: float, at: At, cutoff: float, deadline: float, bisections: int = 4,
               stop: tuple[type[Exception], ...] = ()) -> float:
    """max over the prices tried of L(lam); -inf when no priced solve was proven optimal. A priced
    solve raising one of ``stop`` (out of time) ends the search with the bound so far: every L(lam)
    already proven stays a lower bound."""
    best = [-math.inf]

    def fits(price: float) -> bool:
        proven, _, objective, memory = at(price)
        if proven:
            best[0] = max(best[0], objective + price * (memory - budget_gib))
        return memory <= budget_gib

    lo, hi, price = 0.0, None, 1e-4
    try:
        while price < 1e4 and time.perf_counter() < deadline and best[0] < cutoff:
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
    return best[0]
