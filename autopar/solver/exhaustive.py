"""Exact solve of a small reduced class graph by enumeration (numpy), instead of CP-SAT.

After ``class_graph.reduce_graph`` the problem of a transformer often keeps a handful of
classes (the tied layer, the embedding, the head) with tens of candidates each: CP-SAT spends
~1 s on such a model (mostly set-up), enumeration milliseconds. For classes a_1..a_n with
candidate positions i_1..i_n (all combinations: ``prod |cands|`` <= ``TOTAL`` and, without the
last class, <= ``LIMIT``):

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

LIMIT = 4_000_000       # combinations of all classes but the last: cheaper than CP-SAT's set-up below this
TOTAL = 64_000_000      # and of all classes
CHUNK = 1 << 19


def small_enough(g: ClassGraph, active: list[int]) -> bool:
    sizes = [len(g.cands[a]) for a in active]
    return math.prod(sizes[:-1]) <= LIMIT and math.prod(sizes) <= TOTAL


def enumerate_best(g: ClassGraph, active: list[int], budget: float | None,
                   objective: str = "time", work: Workspace | None = None) -> dict[int, int] | None:
    """The optimal original strategy per live class (``{class: strategy}``), or None when no
    combination is finite and within ``budget``. ``objective``: "time" (compute + resharding) or
    "memory" (the smallest memory among the combinations with finite cost). ``work``: workspace
    the budget also holds. The last class's candidates are a second array axis (each chunk of
    the other classes' combinations is scored against all of them at once), so the terms that do
    not involve it are computed once per combination of the others."""
    work = work or Workspace()
    sizes = [len(g.cands[a]) for a in active]
    *outer, last = active
    n_last = sizes[-1]
    pos = {a: k for k, a in enumerate(outer)}
    inner, cross = [], []       # edges among the outer classes; edges to the last class (outer end, matrices)
    for (a, b), m in g.edges.items():
        kept = g.edge_memory.get((a, b))
        if a in pos and b in pos:
            inner.append((pos[a], pos[b], m, kept))
        elif a in pos and b == last:
            cross.append((pos[a], m, kept))
        elif b in pos and a == last:
            cross.append((pos[b], m.T, None if kept is None else kept.T))
    base = g.fixed_memory + sum(float(g.memory[a].min()) for a in g.alive if a not in pos and a != last)
    base += work.fixed
    total = math.prod(sizes[:-1])
    chunk = max(1, CHUNK // n_last)
    best, best_at = math.inf, -1
    for start in range(0, total, chunk):
        flat = np.arange(start, min(start + chunk, total))
        idx = np.unravel_index(flat, sizes[:-1]) if outer else ()
        cost = np.zeros(len(flat))
        memory = np.full(len(flat), base)
        peak = np.full(len(flat), work.floor)
        for k, a in enumerate(outer):
            cost += g.compute[a][idx[k]]
            memory += g.memory[a][idx[k]]
            if a in work.added:
                memory += work.added[a][idx[k]]
            if a in work.peak:
                peak = np.maximum(peak, work.peak[a][idx[k]])
        for i, j, m, kept in inner:
            cost += m[idx[i], idx[j]]
            if kept is not None:
                memory += kept[idx[i], idx[j]]
        cost2 = cost[:, None] + g.compute[last][None, :]
        memory2 = memory[:, None] + g.memory[last][None, :]
        if last in work.added:
            memory2 += work.added[last][None, :]
        peak2 = np.maximum(peak[:, None], work.peak[last][None, :]) if last in work.peak else peak[:, None]
        memory2 += peak2
        for i, m, kept in cross:
            cost2 += m[idx[i]]
            if kept is not None:
                memory2 += kept[idx[i]]
        ok = np.isfinite(cost2)
        if budget is not None:
            ok &= memory2 <= budget
        score = np.where(ok, memory2 if objective == "memory" else cost2, math.inf)
        at = int(np.argmin(score))
        if score.flat[at] < best:
            best, best_at = float(score.flat[at]), start * n_last + at
    if best_at < 0:
        return None
    choice = np.unravel_index(best_at, sizes)
    picked = {a: int(g.cands[a][0]) for a in g.alive}
    picked.update({a: int(g.cands[a][int(choice[k])]) for k, a in enumerate(active)})
    return picked
