"""The intra-op problem by enumeration: every assignment of the tie classes' allowed strategies
scored at once (numpy), for tests and small problems; ``intra_op.solve_intra_op`` is the solver."""
from __future__ import annotations

import itertools
import math
import time

import numpy as np

from autopar.solver.class_graph import InfeasibleError, is_forbidden
from autopar.solver.intra_op import IntraOpProblem, IntraOpSolution, _tie_classes, _validate


def brute_force(p: IntraOpProblem, max_assignments: int = 2_000_000) -> IntraOpSolution:
    """Exhaustive search over tie classes and allowed strategies (tests and small problems only)."""
    start = time.perf_counter()
    _validate(p)
    class_of = _tie_classes(p)
    roots = list(dict.fromkeys(class_of))
    options = []
    for r in roots:
        group = [v for v in range(len(p.nodes)) if class_of[v] == r]
        opts = set(range(len(p.nodes[r].compute)))
        for v in group:
            opts &= set(p.nodes[v].allowed) if p.nodes[v].allowed is not None else opts
        options.append(sorted(opts))
    if math.prod(len(o) for o in options) > max_assignments:
        raise ValueError(f"brute_force: more than {max_assignments} assignments; use solve_intra_op")
    combos = np.array(list(itertools.product(*options)), dtype=int).reshape(-1, len(roots))
    col = {r: i for i, r in enumerate(roots)}
    choice = combos[:, [col[class_of[v]] for v in range(len(p.nodes))]]
    objective = np.zeros(len(choice))
    memory = np.zeros(len(choice))
    for v, n in enumerate(p.nodes):
        c = np.asarray(n.compute, dtype=float)
        objective += np.where(is_forbidden(c), np.inf, c)[choice[:, v]]
        memory += np.asarray(n.memory, dtype=float)[choice[:, v]]
    for e in p.edges:
        c = np.asarray(e.cost, dtype=float)
        objective += np.where(is_forbidden(c), np.inf, c)[choice[:, e.src], choice[:, e.dst]]
        if e.memory is not None:
            memory += np.asarray(e.memory, dtype=float)[choice[:, e.src], choice[:, e.dst]]
    if p.memory_budget is not None:
        objective = np.where(memory <= p.memory_budget, objective, np.inf)
    best = int(np.argmin(objective)) if len(objective) else 0
    if not len(objective) or not np.isfinite(objective[best]):
        raise InfeasibleError("brute_force: no assignment fits the memory budget and avoids forbidden choices")
    return IntraOpSolution([int(s) for s in choice[best]], float(objective[best]), "OPTIMAL",
                           time.perf_counter() - start, float(memory[best]), 0)


__all__ = ["brute_force"]
