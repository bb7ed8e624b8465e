"""Exact solve of a small reduced class graph by enumeration (numpy), instead of CP-SAT.

After ``class_graph.reduce_graph`` the problem of a transformer often keeps a handful of
classes (the tied layer, the embedding, the head) with tens of candidates each: CP-SAT spends
~1 s on such a model (mostly set-up), enumeration milliseconds. For classes a_1..a_n with
candidate positions i_1..i_n (all combinations, ``prod |cands|`` <= ``LIMIT``):

    cost(i)   = sum_a c_a[i_a] + sum_{(a,b)} R_ab[i_a, i_b]
    memory(i) = fixed + sum_a m_a[i_a] + sum_{(a,b)} G_ab[i_a, i_b]   (bytes an edge's pair keeps)
                + sum_a w_a[i_a] + max(floor, max_a t_a[i_a])             (``Workspace``: sum, max terms)
    pick      argmin cost(i)  subject to  memory(i) <= budget,  cost(i) finite

Exact (no rounding of coefficients), so the result is OPTIMAL. Combinations are visited in
chunks of ``CHUNK`` so the working set stays bounded; ties go to the first combination in
row-major order of the classes' candidate positions.
"""
from __future__ import annotations

import math

import numpy as np

from autopar.solver.class_graph import ClassGraph, Workspace

LIMIT = 4_000_000       # combinations: enumeration is cheaper than CP-SAT's set-up below this
CHUNK = 1 << 19


def small_enough(g: ClassGraph, active: list[int]) -> bool:
    return math.prod(len(g.cands[a]) for a in active) <= LIMIT


def enumerate_best(g: ClassGraph, active: list[int], budget: float | None,
                   objective: str = "time", work: Workspace | None = None) -> dict[int, int] | None:
    """The optimal original strategy per live class (``{class: strategy}``), or None when no
    combination is finite and within ``budget``. ``objective``: "time" (compute + resharding) or
    "memory" (the smallest memory among the combinations with finite cost). ``work``: workspace
    the budget also holds."""
    sizes = [len(g.cands[a]) for a in active]
    pos = {a: k for k, a in enumerate(active)}
    edges = [(pos[a], pos[b], m, g.edge_memory.get((a, b))) for (a, b), m in g.edges.items()
             if a in pos and b in pos]
    base = g.fixed_memory + sum(float(g.memory[a].min()) for a in g.alive if a not in pos)
    total = math.prod(sizes)
    best, best_at = math.inf, -1
    for start in range(0, total, CHUNK):
        flat = np.arange(start, min(start + CHUNK, total))
        idx = np.unravel_index(flat, sizes)
        cost = np.zeros(len(flat))
        memory = np.full(len(flat), base)
        peak = np.full(len(flat), work.floor if work else 0.0)
        for k, a in enumerate(active):
            cost += g.compute[a][idx[k]]
            memory += g.memory[a][idx[k]]
            if work and a in work.added:
                memory += work.added[a][idx[k]]
            if work and a in work.peak:
                peak = np.maximum(peak, work.peak[a][idx[k]])
        memory += peak + (work.fixed if work else 0.0)
        for i, j, m, kept in edges:
            cost += m[idx[i], idx[j]]
            if kept is not None:
                memory += kept[idx[i], idx[j]]
        ok = np.isfinite(cost)
        if budget is not None:
            ok &= memory <= budget
        score = np.where(ok, memory if objective == "memory" else cost, math.inf)
        at = int(np.argmin(score))
        if score[at] < best:
            best, best_at = float(score[at]), start + at
    if best_at < 0:
        return None
    choice = np.unravel_index(best_at, sizes)
    picked = {a: int(g.cands[a][0]) for a in g.alive}
    picked.update({a: int(g.cands[a][int(choice[k])]) for k, a in enumerate(active)})
    return picked
