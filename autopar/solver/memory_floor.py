"""A lower bound on the memory of any strategy assignment of an intra-op problem, computed without a
solve: the budgeted solve refuses a budget under it at once (``intra_op._solve_budgeted``)."""
from __future__ import annotations

import numpy as np

from autopar.solver.class_graph import is_forbidden


def memory_floor(p) -> float:
    """A lower bound on any assignment's memory (``p``: an ``intra_op.IntraOpProblem``): each
    node's least over its allowed, unforbidden strategies plus each edge's least over its
    unforbidden pairs (the coupling ignored). Above
    the budget, no assignment fits, and the time solves are skipped (Llama-7B on (4, 4) and
    (8, 2) at batch 256: 360.7 GiB of 80, 5.4 s each before)."""
    total = 0.0
    for n in p.nodes:
        compute = np.asarray(n.compute, dtype=float)
        ok = ~is_forbidden(compute)
        if n.allowed is not None:
            ok &= np.isin(np.arange(len(compute)), list(n.allowed))
        if not ok.any():
            return 0.0              # infeasible for another reason: let the solve say which
        total += float(np.asarray(n.memory, dtype=float)[ok].min())
    for e in p.edges:
        if e.memory is not None:
            ok = ~is_forbidden(np.asarray(e.cost, dtype=float))
            total += float(np.asarray(e.memory, dtype=float)[ok].min()) if ok.any() else 0.0
    return total
