"""A fitting start for big intra-op problems on meshes of several axes, and the rule that a
time-limited solve never returns anything slower than its start (docs/solver.md, "A fitting start").

On a mesh of n axes a node's strategies are the product of its per-axis choices (``sharding/
strategy.py``): 7 per axis give 49 on two axes, and the problem's pair variables grow with the
square of that. A budgeted problem that big (DeepSeek-V3's whole-model layout on dp 2 x ep 64: 179k
variables) cannot be eliminated or enumerated, and CP-SAT stopped by its time limit returns whatever
it found by then (it once split the attention by heads across nodes where a batch split costs no
communication). Block coordinate descent over the axes gives a good fitting assignment cheaply:

    start: the greedy hint (``greedy.feasible_hint``) when it fits, else the unbudgeted optimum;
    for axis a = 0 .. n-1 (``ROUNDS`` times, or until no axis improves):
        keep every node's per-axis choice on the other axes as in the current assignment, free axis a
        (``allowed`` = the strategies that agree with it there), and solve that restricted problem
        with the same budget (its candidates are the per-axis ones: the reductions, elimination and
        enumeration solve it exactly or nearly); keep its answer when it fits and is faster.

On a named mesh with several data axes the descent also runs from the data-parallel start of
``data_start`` (every batch-carrying op split on every data axis), each start in half the share,
and the faster result is kept: from the greedy hint alone it can stop where one data axis is
gathered and another split by hidden, which no single-axis change leaves.

Each restricted problem contains the current assignment, so the objective never rises. Its result
is the budgeted CP-SAT run's hint and its floor: ``no_worse`` returns the start where a solve that
was not proven optimal came back slower (or found nothing in time). A proven optimum is never
replaced, so plans whose solves are proven are unchanged.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np

from autopar.core import search_memo
from autopar.solver.intra_op import (DominatedError, InfeasibleError, IntraOpProblem, IntraOpSolution, SolverTimeoutError, evaluate,
                                     solve_free_exact,
                                     solve_intra_op, workspace_bytes)
from autopar.solver.class_graph import allowed_mask
from autopar.solver.data_start import data_start
from autopar.solver.memory_floor import memory_floor

ROUNDS = 2               # sweeps over the axes
DESCENT_PAIRS = 100_000  # the descent runs when the problem has more (src, dst) strategy pairs than this
SHARE = 0.4              # of the time limit the descent may use


@dataclass
class Start:
    choice: list[int]
    objective: float
    memory: float
    how: str             # "greedy", "descent"


def axis_keys(strategies: list[list]) -> list[np.ndarray]:
    """Per node, an int array [strategies, axes]: equal entries in column a mean the same choice on
    axis a (inputs', outputs' placements and local implementation there)."""
    ids: dict = {}
    out = []
    if search_memo.ENABLED:     # repeated layers share their Strategy objects (and often whole lists):
        return _axis_keys_shared(strategies, ids)   # each is keyed once, by identity
    for sts in strategies:
        rows = [[ids.setdefault(_axis_part(st, a), len(ids)) for a in range(len(st.local))] for st in sts]
        width = len(rows[0]) if rows else 0
        out.append(np.array(rows, dtype=np.int64).reshape(len(sts), width))
    return out


def _axis_keys_shared(strategies: list[list], ids: dict) -> list[np.ndarray]:
    """``axis_keys`` with each Strategy object's row computed once and each list of the same objects
    built once (shared, read-only): a strategy seen before adds no id, so the numbering is the plain
    loop's. Every strategy is alive in ``strategies`` while this runs, so identities are not reused."""
    row_of: dict[int, list[int]] = {}
    by_list: dict[tuple, np.ndarray] = {}
    out = []
    for sts in strategies:
        ident = tuple(map(id, sts))
        keys = by_list.get(ident)
        if keys is None:
            rows = []
            for st in sts:
                row = row_of.get(id(st))
                if row is None:
                    row = row_of[id(st)] = [ids.setdefault(_axis_part(st, a), len(ids)) for a in range(len(st.local))]
                rows.append(row)
            width = len(rows[0]) if rows else 0
            keys = by_list[ident] = np.array(rows, dtype=np.int64).reshape(len(sts), width)
            keys.flags.writeable = False
        out.append(keys)
    return out


def _at(spec, a: int):
    """Placement on axis ``a`` of a Spec, or the tuple of them for a tuple of Specs (multi-output)."""
    if isinstance(spec, tuple) and spec and all(s is None or isinstance(s, tuple) for s in spec):
        return tuple(None if s is None else s[a] for s in spec)
    return spec[a] if isinstance(spec, tuple) and len(spec) > a else spec


def _axis_part(st, a: int) -> tuple:
    return tuple(_at(s, a) for s in st.inputs), _at(st.output, a), st.local[a]


def pair_count(p) -> int:
    """(src, dst) strategy pairs of the problem's edges: what its CP-SAT model's size grows with."""
    return int(sum(np.size(e.cost) for e in p.edges))


def wants_descent(p) -> bool:
    keys = getattr(p, "axis_keys", None)
    if not keys or len(keys) != len(p.nodes) or pair_count(p) <= DESCENT_PAIRS:
        return False
    return any(k.shape[1] > 1 and len(np.unique(k[:, a])) > 1 for k in keys for a in range(k.shape[1]))


def assess(p, choice: list[int] | None, how: str) -> Start | None:
    """``choice`` as a Start when it is finite and fits the budget with its workspace, else None."""
    if choice is None or len(choice) != len(p.nodes):
        return None
    objective, memory = evaluate(p, list(choice))
    if not math.isfinite(objective):
        return None
    if p.memory_budget is not None and memory + workspace_bytes(p, list(choice)) > p.memory_budget:
        return None
    return Start(list(choice), objective, memory, how)


def _restricted(p, keys: list[np.ndarray], current: list[int], axis: int):
    """``p`` with each node limited to the strategies that agree with ``current`` on every axis but ``axis``."""
    nodes = []
    agree: dict = {}        # (keys, choice) -> the agreeing strategies: tied layers repeat both (``axis_keys``)
    for node, k, s in zip(p.nodes, keys, current):
        hit = agree.get((id(k), s)) if search_memo.ENABLED else None
        if hit is None:
            others = [b for b in range(k.shape[1]) if b != axis]
            mask = np.all(k[:, others] == k[s, others], axis=1) if others else np.ones(len(k), dtype=bool)
            hit = agree[(id(k), s)] = (mask, np.flatnonzero(mask).tolist())
        mask, kept = hit        # nodes without their own ``allowed`` share one list (read-only)
        if node.allowed is not None:
            kept = np.flatnonzero(mask & allowed_mask(len(k), node.allowed)).tolist()
        nodes.append(dataclasses.replace(node, allowed=kept))
    return nodes


def descend(p: IntraOpProblem, solve, start: list[int], deadline: float) -> Start | None:
    """Block coordinate descent over the mesh axes from ``start`` (module docstring); ``solve`` is
    ``intra_op.solve_intra_op``. None when ``start`` does not fit and no restricted solve fits."""
    keys = p.axis_keys
    axes = max(k.shape[1] for k in keys)
    best = assess(p, start, "greedy")
    current = list(start)
    steps = [a for _ in range(ROUNDS) for a in range(axes)]
    since = 0                 # axes at their best given the others (stop when all are)
    for i, axis in enumerate(steps):
        left = deadline - time.perf_counter()
        if left <= 0 or since >= axes:
            break
        q = dataclasses.replace(p, nodes=_restricted(p, keys, current, axis), hint=current, cutoff=None,
                                axis_keys=None, time_limit_s=max(left / (len(steps) - i), 0.1))
        since += 1
        try:
            sol = solve(q)
        except (InfeasibleError, SolverTimeoutError):
            continue
        found = assess(p, sol.choice, "descent")
        if found is not None and (best is None or found.objective < best.objective * (1 - 1e-9)):
            best, current, since = found, list(sol.choice), 1     # this axis is now at its best
    return best


def no_worse(sol, start: Start | None, began: float):
    """``sol`` unless it was not proven optimal and ``start`` is faster (then the start, status
    "FEASIBLE(start)")."""
    if start is None or sol.status == "OPTIMAL" or sol.objective <= start.objective:
        return sol
    return dataclasses.replace(sol, choice=list(start.choice), objective=start.objective, memory=start.memory,
                               status="FEASIBLE(start)", solve_time=time.perf_counter() - began)


def solve_with_start(p: IntraOpProblem, solve=solve_intra_op) -> IntraOpSolution:
    """``solve`` (``intra_op.solve_intra_op``) started from a fitting assignment (a big problem on several
    axes: ``descend`` within ``SHARE`` of the time limit, from the greedy hint and from the data-parallel
    start of ``data_start`` where the problem has one, the faster; the others: the greedy hint, with the
    data-parallel start beside it as the floor), and never slower than that start unless proven optimal."""
    began = time.perf_counter()
    hopeless = p.memory_budget is not None and memory_floor(p) > p.memory_budget    # raises its explanation at once
    if p.hint is None or hopeless or not wants_descent(p):
        sol = solve(p)      # a smaller problem: solved as before; not proven, the data start is a floor too
        floor = assess(p, p.hint, "greedy")
        if sol.status != "OPTIMAL" and not hopeless:
            floor = _fastest([floor, assess(p, data_start(p, solve), "data")])
        return no_worse(sol, floor, began)
    answer, free = free_first(p)
    if answer is not None:
        return answer
    after = time.perf_counter()         # the descent's share counts from here: the free solve does not shorten it
    data = data_start(p, solve)
    end = after + SHARE * p.time_limit_s
    seeds = [descend(p, solve, list(p.hint), end if data is None else (after + end) / 2)]
    if data is not None:
        seeds.append(descend(p, solve, data, end))
    seed = _fastest(seeds)
    q = dataclasses.replace(p, free=free) if seed is None else \
        dataclasses.replace(p, hint=seed.choice, hint_fits=True, free=free)
    return no_worse(solve(q), seed or assess(p, p.hint, "greedy"), began)


def free_first(p: IntraOpProblem) -> tuple[IntraOpSolution | None, IntraOpSolution | None]:
    """(answer, free). What ``intra_op._after_free`` decides from the unbudgeted optimum, decided before
    the descent (which only seeds the budgeted solve), where that optimum comes from the reductions and
    elimination alone (``solve_free_exact``; where it needs CP-SAT, nothing is decided here: the
    budgeted solve solves it after the descent, hinted by the descent's result). The answer is the
    optimum when it fits the budget (then it is the budgeted optimum too); ``DominatedError``
    (unbudgeted) is raised when it reaches ``p.cutoff``. Else no answer, and ``free`` is that optimum
    for the budgeted solve (``IntraOpProblem.free``), which then does not solve it again."""
    free = solve_free_exact(p)
    if free is None:
        return None, None
    if p.memory_budget is None or free.memory <= p.memory_budget:
        return dataclasses.replace(free, free_bound=free.lower_bound), None
    if p.cutoff is not None and free.lower_bound >= p.cutoff:
        err = DominatedError(free.lower_bound, p.cutoff, unbudgeted=True)
        err.free_bound = free.lower_bound
        raise err
    return None, free


def _fastest(starts: list[Start | None]) -> Start | None:
    found = [s for s in starts if s is not None]
    return min(found, key=lambda s: s.objective) if found else None
