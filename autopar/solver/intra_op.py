"""Intra-op parallelism: choose one sharding strategy per op group (Alpa's intra-op ILP, CP-SAT).

Problem (``IntraOpProblem``): nodes v with candidate strategies s, compute c[v,s] (seconds, the
strategy's own collectives included) and memory m[v,s] (bytes live at the peak); edges (u, v) with
resharding time R[u,v][i,j] and optionally bytes G[u,v][i,j] the pair keeps; an optional budget M;
ties (node groups that pick the same index); optional transients t[v,s], a[v,s].

ILP (``cpsat_model.build_model``): x[v,s] one-hot per node, e[u,v,i,j] per allowed pair, coupled by
the exact transportation linearisation (sum_j e[u,v,i,j] = x[u,i], sum_i e[u,v,i,j] = x[v,j]);
    minimise    sum c[v,s] x[v,s] + sum R[u,v][i,j] e[u,v,i,j]
    subject to  sum m x + sum G e + sum a x + W <= M,   W >= sum_s t[v,s] x[v,s] per class.
Costs are shifted >= 0 and scaled to integers (largest ~1e9); memories round up and the budget down,
so a reported solution always fits. A strategy or pair costing >= HUGE_COST (or not finite) gets no
variable. Ties are substituted: a tie group is one class with its members' costs summed.

Solve (``solve_intra_op``), exact unless marked:
  1. a budget under ``memory_floor`` raises the memory explanation without a budgeted solve; under a
     ``cutoff`` the unbudgeted optimum is solved first and, when it reaches the cutoff, raises
     ``DominatedError`` (unbudgeted: a bound for any budget, so the search drops the mesh at every
     larger accumulation and recomputation instead of solving it again there; ``HOPELESS_BOUND``);
  2. reductions (``class_graph.reduce_graph``): dominated strategies, folds, min-plus elimination
     of classes of degree <= 2;
  3. unbudgeted (free and priced solves): variable elimination (``elimination``) under its LIMIT,
     else enumeration when few combinations remain (``exhaustive.small_enough``), else CP-SAT;
  4. budgeted: the unbudgeted optimum first (the answer if it fits, else the hint). Under a
     ``cutoff`` the Lagrangian bound L(lam) = min_x[time(x) + lam memory(x)] - lam M <= the budgeted
     optimum (``_dual_bound``) raises ``DominatedError`` once it reaches the cutoff, and the CP-SAT
     model gets the ceiling row objective <= cutoff; a model too large to build is priced instead
     (``_lagrangian``: FEASIBLE, the duality gap not closed).
An infeasible budget is explained by the least memory (``_memory_error``). Status "OPTIMAL" only
when proven, else "FEASIBLE". CP-SAT 9.15's inclusion presolve is off (google/or-tools#5293).
The derivations and the measured cases behind each step: docs/solver.md.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace

import numpy as np
from ortools.sat.python import cp_model

from autopar.core import search_memo
from autopar.solver.class_graph import (HUGE_COST, ClassGraph, InfeasibleError, allowed_mask, is_forbidden,
                                         recover_choices, reduce_graph)
from autopar.solver.cpsat_model import (OverBudget, active_classes, build_model, objective_bound, picked_strategies,
                                        run_model, workspace_of)
from autopar.solver.elimination import eliminate_best
from autopar.solver.exhaustive import enumerate_best, small_enough
from autopar.solver.memory_floor import memory_floor
from autopar.solver.pricing import Dual, dual_bound, priced_search

GIB = float(1 << 30)
DUAL_SHARE = 0.7             # the bound's solves end by this share of the time limit (the rest: the budgeted solve)
GAP = 0.01                   # a budgeted solution within this share of the proven lower bound ends the search
LAGRANGIAN_PAIRS = 200_000   # a budgeted model with more edge-pair variables is solved by ``_lagrangian``
# a budget under the memory floor with a cutoff: the unbudgeted bound first (``_hopeless``); off
# (``AUTOPAR_HOPELESS_BOUND=0``) for the test that compares the search's plans with and without it
HOPELESS_BOUND: bool = os.environ.get("AUTOPAR_HOPELESS_BOUND", "1") != "0"


class SolverTimeoutError(RuntimeError):
    """CP-SAT found no assignment within the time limit."""


class DominatedError(Exception):
    """The problem's proven lower bound is at least its ``cutoff``: it cannot beat the plan the
    cutoff came from (docs/solver.md, Bound)."""

    def __init__(self, lower_bound: float, cutoff: float, unbudgeted: bool):
        super().__init__(f"cannot beat the best plan so far: its lower bound {lower_bound:.4g} >= {cutoff:.4g}"
                         + (" without a memory budget" if unbudgeted else " under the memory budget"))
        self.lower_bound = lower_bound
        self.cutoff = cutoff
        self.unbudgeted = unbudgeted    # the bound ignores memory (lam = 0): it holds for any budget
        if unbudgeted:                  # then it is the problem's bound at any budget (the search's floor)
            self.free_bound = lower_bound


@dataclass
class NodeChoices:
    name: str
    compute: np.ndarray  # [k] seconds
    memory: np.ndarray  # [k] bytes
    allowed: list[int] | None = None


@dataclass
class EdgeCost:
    src: int
    dst: int
    cost: np.ndarray  # [k_src, k_dst] seconds
    memory: np.ndarray | None = None  # [k_src, k_dst] bytes the pair keeps (G), None: none


@dataclass
class IntraOpProblem:
    nodes: list[NodeChoices]
    edges: list[EdgeCost]
    memory_budget: float | None = None
    ties: list[list[int]] = ()
    time_limit_s: float = 10.0
    workers: int = 2
    hint: list[int] | None = None  # a feasible assignment (e.g. greedy): CP-SAT starts from it, and it is
                                   # returned (status "FEASIBLE(hint)") if CP-SAT finds nothing in time
    cutoff: float | None = None    # objective a budgeted solve must beat (docs/solver.md, Bound)
    transient: tuple[list, list] | None = None  # (max terms, sum terms): per node, bytes by strategy (or
                                   # None) of workspace beside the row (docs/solver.md, Transients)
    axis_keys: list | None = None  # per node, [strategies, mesh axes] ids of its per-axis choices (``axis_descent``)
    hint_fits: bool = False        # the hint fits the budget: a budgeted CP-SAT run starts from it, not from
                                   # the unbudgeted optimum that does not fit (``axis_descent``)
    data_allowed: list | None = None  # per node, its batch-split strategies on every data axis or None: a
                                   # second start (``data_start``; ``axis_descent.solve_with_start``)
    free: object = None            # the unbudgeted problem's exact solution, already solved (``axis_descent.free_first``)
    explain: bool = True           # under the memory floor: solve for the least memory (the error's explanation and
                                   # ``least_memory``); False where the caller discards the error (``_memory_error``)


@dataclass
class IntraOpSolution:
    choice: list[int]
    objective: float
    status: str  # "OPTIMAL" or "FEASIBLE"
    solve_time: float
    memory: float
    num_vars: int
    bound: bool = False     # the memory budget shaped it: the unbudgeted optimum does not fit
    lower_bound: float = -math.inf  # proven: no assignment of an unbudgeted problem is faster
    free_bound: float = -math.inf   # proven for the problem without its budget (``_solve_budgeted``'s
                                    # free solve; also on its InfeasibleError / DominatedError as ``free_bound``)


# ---------------------------------------------------------------- problem -> class graph

def _validate(p: IntraOpProblem) -> None:
    checked: set = set()        # (allowed list, strategies) checked already: tied members share lists
    for v, node in enumerate(p.nodes):
        if np.shape(node.compute) != np.shape(node.memory) or np.ndim(node.compute) != 1 or not len(node.compute):
            raise ValueError(f"node {v} ({node.name}): compute and memory must be equal-length non-empty 1-D arrays")
        if node.allowed is not None and (id(node.allowed), len(node.compute)) not in checked and \
                any(not 0 <= s < len(node.compute) for s in node.allowed):
            raise ValueError(f"node {v} ({node.name}): allowed {node.allowed} outside 0..{len(node.compute) - 1}")
        if node.allowed is not None and search_memo.ENABLED:
            checked.add((id(node.allowed), len(node.compute)))
    for e in p.edges:
        if not (0 <= e.src < len(p.nodes) and 0 <= e.dst < len(p.nodes)):
            raise ValueError(f"edge ({e.src}, {e.dst}) refers to a node outside 0..{len(p.nodes) - 1}")
        want = (len(p.nodes[e.src].compute), len(p.nodes[e.dst].compute))
        if np.shape(e.cost) != want:
            raise ValueError(f"edge ({e.src}, {e.dst}): cost shape {np.shape(e.cost)} != {want}")
        if e.memory is not None and np.shape(e.memory) != want:
            raise ValueError(f"edge ({e.src}, {e.dst}): memory shape {np.shape(e.memory)} != {want}")
    for group in p.ties:
        ks = {len(p.nodes[v].compute) for v in group}
        if len(ks) > 1:
            raise ValueError(f"tied nodes {list(group)} have different strategy counts {sorted(ks)}")


def _tie_classes(p: IntraOpProblem) -> list[int]:
    parent = list(range(len(p.nodes)))

    def find(v: int) -> int:
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    for group in p.ties:
        for v in group[1:]:
            parent[find(v)] = find(group[0])
    return [find(v) for v in range(len(p.nodes))]


def _collapse_ties(p: IntraOpProblem) -> tuple[ClassGraph, list[int]]:
    """One class per tie group: summed compute/memory, candidates = intersection of ``allowed``."""
    roots = _tie_classes(p)
    index = {r: i for i, r in enumerate(dict.fromkeys(roots))}
    class_of = [index[r] for r in roots]
    members: list[list[int]] = [[] for _ in index]
    for v, a in enumerate(class_of):
        members[a].append(v)
    g = ClassGraph(members, [], [], [], nbrs=[set() for _ in members], alive=set(range(len(members))),
               budgeted=p.memory_budget is not None)
    for group in members:
        k = len(p.nodes[group[0]].compute)
        keep = np.ones(k, dtype=bool)
        applied: set = set()        # tied members often share one ``allowed`` list (``axis_descent``)
        for v in group:
            allowed = p.nodes[v].allowed
            if allowed is not None and id(allowed) not in applied:
                keep &= allowed_mask(k, allowed)
                if search_memo.ENABLED:
                    applied.add(id(allowed))
        compute = sum(np.asarray(p.nodes[v].compute, dtype=float) for v in group)
        memory = sum(np.asarray(p.nodes[v].memory, dtype=float) for v in group)
        g.cands.append(np.arange(k))
        g.compute.append(np.where(is_forbidden(compute), np.inf, compute))
        g.memory.append(np.where(np.isfinite(memory), memory, np.inf))
        if p.transient and p.memory_budget is not None:
            peak = [p.transient[0][v] for v in group if p.transient[0][v] is not None]
            added = [p.transient[1][v] for v in group if p.transient[1][v] is not None]
            if peak or added:
                g.workspace[len(g.cands) - 1] = np.stack([sum(added, np.zeros(k)), np.max(peak, axis=0) if peak
                                                          else np.zeros(k)], axis=1)
        g.restrict(len(g.cands) - 1, keep)
    return g, class_of


def _map_edges(p: IntraOpProblem, g: ClassGraph, class_of: list[int]) -> None:
    """Edges onto classes; parallel edges summed; an edge inside a class adds its diagonal (time
    to the class's compute, kept bytes to its memory)."""
    picks: dict = {}    # (tables, classes) -> the picked tables: repeated layers' edges share their tables
    for e in p.edges:
        a, b = class_of[e.src], class_of[e.dst]
        key = (id(e.cost), id(e.memory), a, b)
        if a != b and key in picks:
            g.add_edge(a, b, *picks[key])
            continue
        cost = np.asarray(e.cost, dtype=float)
        cost = np.where(is_forbidden(cost), np.inf, cost)
        mem = None if e.memory is None else np.asarray(e.memory, dtype=float)
        if a == b:
            c = g.cands[a]
            g.compute[a] = g.compute[a] + cost[c, c]
            if mem is not None:
                g.memory[a] = g.memory[a] + mem[c, c]
        else:
            pick = np.ix_(g.cands[a], g.cands[b])
            picked = (cost[pick], None if mem is None else mem[pick])
            if search_memo.ENABLED:
                picks[key] = picked
            g.add_edge(a, b, *picked)


def _memory_problem(p: IntraOpProblem) -> IntraOpProblem:
    """The same choices with memory (GiB) as the objective and no budget; a forbidden compute or
    resharding choice stays forbidden. Unbudgeted, the reductions remove chains and trees."""
    nodes = [NodeChoices(n.name, np.where(is_forbidden(np.asarray(n.compute, dtype=float)), np.inf,
                                          np.asarray(n.memory, dtype=float) / GIB), n.memory, n.allowed)
             for n in p.nodes]
    edges = [EdgeCost(e.src, e.dst, np.where(is_forbidden(np.asarray(e.cost, dtype=float)), np.inf,
                                             0.0 if e.memory is None else np.asarray(e.memory, dtype=float) / GIB),
                      e.memory) for e in p.edges]
    return IntraOpProblem(nodes, edges, None, p.ties, p.time_limit_s, p.workers)


def _memory_error(p: IntraOpProblem) -> InfeasibleError:
    """Solve for the smallest achievable memory and explain the gap to the budget."""
    try:
        sol = _solve(_memory_problem(p), time.perf_counter() + p.time_limit_s, None, time.perf_counter())
    except (InfeasibleError, SolverTimeoutError):
        return InfeasibleError(
            "no strategy assignment avoids forbidden (infinite or >= HUGE_COST) compute/resharding choices, "
            "even ignoring memory; check the op rules and annotations")
    choice = sol.choice
    smallest = evaluate(p, choice)[1]
    word = "smallest achievable" if sol.status == "OPTIMAL" else "smallest found"
    if smallest <= p.memory_budget:     # the row fits: the backward workspace beside it does not
        err = InfeasibleError(
            f"no strategy assignment fits the memory budget of {p.memory_budget / GIB:.3f} GiB "
            f"({p.memory_budget:.4g} B) together with the backward workspace of its largest op: the {word} "
            f"memory without it is {smallest / GIB:.3f} GiB. Use more devices (a larger tensor/data-parallel "
            f"mesh), smaller microbatches (gradient accumulation), activation checkpointing, or raise the budget")
        err.choice = choice
        err.least_memory = None
        return err
    err = InfeasibleError(
        f"no strategy assignment fits the memory budget: the {word} memory is {smallest / GIB:.3f} GiB "
        f"({smallest:.4g} B) but the budget is {p.memory_budget / GIB:.3f} GiB ({p.memory_budget:.4g} B). "
        f"Use more devices (a larger tensor/data-parallel mesh), pipeline parallelism (fewer layers per stage), "
        f"activation checkpointing or optimizer-state sharding, or raise the budget")
    err.choice = choice             # the smallest assignment: callers break its memory down
    err.least_memory = smallest if sol.status == "OPTIMAL" else None     # a proven minimum of the row
    return err


def _floor_error(p: IntraOpProblem, floor: float) -> InfeasibleError:
    """The memory floor over the budget, unexplained: no least-memory solve (``IntraOpProblem.explain``)."""
    err = InfeasibleError(f"no strategy assignment fits the memory budget of {p.memory_budget / GIB:.3f} GiB: every "
                          f"assignment needs at least {floor / GIB:.3f} GiB (the memory floor)")
    err.choice = None
    err.least_memory = None
    return err


def _expand(class_of: list[int], picked: dict[int, int]) -> list[int]:
    return [picked[a] for a in class_of]


# ---------------------------------------------------------------- public API

def evaluate(p: IntraOpProblem, choice: list[int]) -> tuple[float, float]:
    """(objective seconds, memory bytes) of an assignment; objective inf if a forbidden choice is used."""
    if search_memo.ENABLED:     # the same sums, and one forbidden test over the picked values
        node_times = [float(n.compute[s]) for n, s in zip(p.nodes, choice)]
        edge_times = [float(e.cost[choice[e.src], choice[e.dst]]) for e in p.edges]
        total = sum(node_times)
        total += sum(edge_times)
        forbidden = bool(is_forbidden(np.array(node_times + edge_times, dtype=float)).any())
        memory = sum(float(n.memory[s]) for n, s in zip(p.nodes, choice)) + edge_memory(p, choice)
        return (math.inf if forbidden else total), memory
    total = sum(float(n.compute[s]) for n, s in zip(p.nodes, choice))
    total += sum(float(e.cost[choice[e.src], choice[e.dst]]) for e in p.edges)
    forbidden = any(is_forbidden(np.asarray(n.compute[s])) for n, s in zip(p.nodes, choice)) or any(
        is_forbidden(np.asarray(e.cost[choice[e.src], choice[e.dst]])) for e in p.edges)
    memory = sum(float(n.memory[s]) for n, s in zip(p.nodes, choice)) + edge_memory(p, choice)
    return (math.inf if forbidden else total), memory


def workspace_bytes(p: IntraOpProblem, choice: list[int]) -> float:
    """The workspace the budget keeps room for beside the row (``IntraOpProblem.transient``): the
    largest max term of the picks plus their sum terms; 0 without transients."""
    if p.transient is None:
        return 0.0
    peak, added = p.transient
    return (max((float(t[s]) for t, s in zip(peak, choice) if t is not None), default=0.0)
            + sum(float(a[s]) for a, s in zip(added, choice) if a is not None))


def edge_memory(p: IntraOpProblem, choice: list[int]) -> float:
    """Bytes the edges' chosen pairs keep (sum of G)."""
    return sum(float(e.memory[choice[e.src], choice[e.dst]]) for e in p.edges if e.memory is not None)


def solve_intra_op(p: IntraOpProblem) -> IntraOpSolution:
    """Optimal (or best within the time limit) strategy per node; see the module docstring.

    With a budget, the problem is first solved without it (often fully by the reductions, as
    memory no longer blocks elimination) in at most half the time: if that optimum fits the
    budget it is optimal for the budgeted problem too; otherwise it seeds CP-SAT's hint.
    """
    start = time.perf_counter()
    _validate(p)
    try:
        return _solve_budgeted(p, start)
    except SolverTimeoutError:
        fallback = _hint_solution(p, start)
        if fallback is None:
            raise
        return fallback


def _hint_solution(p: IntraOpProblem, start: float) -> IntraOpSolution | None:
    """The given hint as a solution, when it is feasible and fits the budget."""
    if p.hint is None:
        return None
    objective, memory = evaluate(p, list(p.hint))
    if math.isinf(objective) or (p.memory_budget is not None and memory > p.memory_budget):
        return None
    return IntraOpSolution(list(p.hint), objective, "FEASIBLE(hint)", time.perf_counter() - start, memory, 0)


def _solve_budgeted(p: IntraOpProblem, start: float) -> IntraOpSolution:
    if p.memory_budget is None:
        return _solve(p, start + p.time_limit_s, p.hint, start)
    if (floor := memory_floor(p)) > p.memory_budget:
        bound = _hopeless(p, start)     # raises DominatedError when the unbudgeted bound reaches the cutoff
        err = _memory_error(p) if p.explain else _floor_error(p, floor)   # no assignment can fit
        err.free_bound = bound
        raise err
    if p.free is not None:          # solved before (``axis_descent.free_first``): its time counts as here
        start -= p.free.solve_time
    try:
        free = p.free if p.free is not None else \
            _solve(replace(p, memory_budget=None), start + p.time_limit_s / 2, p.hint, start)
    except SolverTimeoutError:
        return _solve(p, start + p.time_limit_s, p.hint, start)
    try:
        return replace(_after_free(p, start, free), free_bound=free.lower_bound)
    except (InfeasibleError, DominatedError, SolverTimeoutError) as err:
        err.free_bound = free.lower_bound   # the search's bound for this mesh at any budget
        raise


def _after_free(p: IntraOpProblem, start: float, free: IntraOpSolution) -> IntraOpSolution:
    """The budgeted solve once the unbudgeted optimum ``free`` is known (module docstring, step 4)."""
    fits = free.memory <= p.memory_budget
    hint = free.choice if p.hint is None or not (fits or p.hint_fits) else p.hint
    if fits and free.status == "OPTIMAL":
        return free
    if p.cutoff is not None and free.lower_bound >= p.cutoff:
        raise DominatedError(free.lower_bound, p.cutoff, unbudgeted=True)
    good_enough = None
    if p.cutoff is not None and not fits:
        dual = _dual_bound(p, start + DUAL_SHARE * p.time_limit_s, start, free)
        lower = max(dual.bound, free.lower_bound)
        if lower >= p.cutoff:
            raise DominatedError(lower, p.cutoff, unbudgeted=False)
        good_enough = (1 + GAP) * lower
        if dual.fit is not None and dual.fit_objective <= good_enough:
            fit_memory = evaluate(p, dual.fit)[1]
            return IntraOpSolution(dual.fit, dual.fit_objective, "FEASIBLE(gap)", time.perf_counter() - start,
                                   fit_memory, 0, bound=True)
        if dual.fit is not None:
            hint = dual.fit     # fits with its workspace: a far better start than the memory-hungry optimum
    try:
        budgeted = _solve(p, start + p.time_limit_s, hint, start, relax=free.status == "OPTIMAL",
                          good_enough=good_enough, ceiling=p.cutoff)
    except SolverTimeoutError:
        if fits:
            return replace(free, solve_time=time.perf_counter() - start)
        if (found := _hint_solution(replace(p, hint=hint), start)) is not None:
            return found        # the dual bound's fitting choice
        raise
    return free if fits and free.objective < budgeted.objective else replace(budgeted, bound=not fits)


def _hopeless(p: IntraOpProblem, start: float) -> None:
    """For a budget under the memory floor and a ``cutoff``: raise ``DominatedError`` (unbudgeted) when
    the unbudgeted problem's proven lower bound reaches the cutoff. The bound holds for any budget, and
    the search's unbudgeted bounds only grow with accumulation and recomputation, so the mesh is then
    dropped for good (``search._stops_mesh``) where an ``InfeasibleError`` would have it solved again at
    every larger accumulation and with more recomputation. Within half the time limit; a timeout
    leaves the memory explanation to be raised. Returns the bound (-inf when not solved)."""
    if not HOPELESS_BOUND or p.cutoff is None:
        return -math.inf
    try:
        free = _solve(replace(p, memory_budget=None), start + p.time_limit_s / 2, p.hint, start)
    except (SolverTimeoutError, InfeasibleError):
        return -math.inf
    if free.lower_bound >= p.cutoff:
        raise DominatedError(free.lower_bound, p.cutoff, unbudgeted=True)
    return free.lower_bound


class NeedsSearch(Exception):
    """``solve_free_exact``: what the reductions leave needs CP-SAT (or the Lagrangian), not elimination."""


def solve_free_exact(p: IntraOpProblem) -> IntraOpSolution | None:
    """The problem without its budget solved exactly by the reductions, elimination or enumeration
    (``_solve``'s free path), as ``_solve_budgeted`` would solve it; None where that needs CP-SAT."""
    _validate(p)
    start = time.perf_counter()
    try:
        return _solve(replace(p, memory_budget=None), math.inf, p.hint, start, exact_only=True)
    except NeedsSearch:
        return None


def _solve(p: IntraOpProblem, deadline: float, hint: list[int] | None, start: float,
           relax: bool = False, good_enough: float | None = None, ceiling: float | None = None,
           exact_only: bool = False) -> IntraOpSolution:
    """Reduce, then eliminate (no budget, ``elimination``) or enumerate (a small remainder,
    ``exhaustive``), or price the budget (``_lagrangian``, when ``relax``: the unbudgeted problem
    solved to optimality, so priced ones will too, and the budgeted model is large), or build and
    run CP-SAT until ``deadline`` (perf_counter seconds) or, given ``good_enough`` (seconds), until
    a solution that fast. ``ceiling`` (seconds; CP-SAT only): assignments at least that slow are
    cut from the model, and its INFEASIBLE then raises ``DominatedError``."""
    g, class_of = _collapse_ties(p)
    _map_edges(p, g, class_of)
    reduce_graph(g)
    active = active_classes(g)
    num_vars = sum(len(g.cands[a]) for a in active)
    lower = -math.inf
    if not active:
        status, picked = cp_model.OPTIMAL, {a: int(g.cands[a][0]) for a in g.alive}
        if p.memory_budget is not None and evaluate(p, _expand(class_of, recover_choices(g, dict(picked))))[1] > \
                p.memory_budget:
            raise _no_assignment(p)     # nothing left to choose, and it does not fit
    elif p.memory_budget is None and (eliminated := eliminate_best(g, active)) is not None:
        if math.isinf(eliminated[0]):
            raise _no_assignment(p)
        status, picked = cp_model.OPTIMAL, eliminated[1]
    elif small_enough(g, active):
        status, picked = cp_model.OPTIMAL, enumerate_best(g, active, p.memory_budget,
                                                          work=workspace_of(g) if p.memory_budget is not None else None)
        if picked is None:
            raise _no_assignment(p)
    elif exact_only:
        raise NeedsSearch()
    elif relax and p.memory_budget is not None and _pair_vars(g) > LAGRANGIAN_PAIRS and \
            (relaxed := _lagrangian(p, deadline, start)) is not None:
        return relaxed
    else:
        try:
            mdl, active = build_model(g, p.memory_budget, hint=_class_hint(class_of, hint),
                                      work=workspace_of(g) if p.memory_budget is not None else None, ceiling=ceiling)
        except OverBudget:
            raise _memory_error(p) from None
        num_vars = mdl.num_vars
        solver, status = run_model(mdl, max(deadline - time.perf_counter(), 0.1), p.workers, good_enough)
        if status == cp_model.INFEASIBLE and ceiling is not None:
            raise DominatedError(ceiling, ceiling, unbudgeted=False)
        if status == cp_model.INFEASIBLE:
            raise _no_assignment(p)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            raise SolverTimeoutError(
                f"CP-SAT found no assignment within {p.time_limit_s:g} s ({mdl.num_vars} variables, "
                f"status {solver.StatusName(status)}); raise the solver's time limit "
                f"(autopar.set_auto_parallel_context(solver_time_limit=...)) or the memory cap")
        picked = picked_strategies(g, mdl, active, solver)
        if p.memory_budget is None:   # the budgeted model's rounding restricts it: its bound is not one
            lower = objective_bound(mdl, solver)
    choice = _expand(class_of, recover_choices(g, picked))
    objective, memory = evaluate(p, choice)
    if status == cp_model.OPTIMAL:
        lower = objective
    return IntraOpSolution(choice, objective, "OPTIMAL" if status == cp_model.OPTIMAL else "FEASIBLE",
                           time.perf_counter() - start, memory, num_vars, lower_bound=min(lower, objective))


def _pair_vars(g: ClassGraph) -> int:
    """How many edge-pair variables the CP-SAT model of ``g`` would have."""
    return int(sum(np.isfinite(m).sum() for m in g.edges.values()))


def _priced(p: IntraOpProblem, deadline: float, start: float, hint: list[int] | None = None):
    """``at(price)`` of ``solver/pricing.py``: the unbudgeted problem with node and kept edge bytes
    priced at ``price`` s/GiB -> (proven lower bound on the priced optimum, choice, unpriced
    objective, memory GiB). Each CP-SAT run starts from the previous price's choice (the first from
    ``hint``): neighbouring prices have neighbouring optima."""
    mem = [np.asarray(n.memory, dtype=float) / GIB for n in p.nodes]
    last = [hint]

    def at(price: float):
        nodes = [replace(n, compute=np.asarray(n.compute, dtype=float) + price * m) for n, m in zip(p.nodes, mem)]
        edges = [e if e.memory is None else replace(e, cost=np.asarray(e.cost, dtype=float) + price * e.memory / GIB)
                 for e in p.edges]
        sol = _solve(replace(p, nodes=nodes, edges=edges, memory_budget=None, hint=None, cutoff=None), deadline,
                     last[0], start)
        last[0] = sol.choice
        objective, memory = evaluate(p, sol.choice)
        return sol.lower_bound, sol.choice, objective, (memory + workspace_bytes(p, sol.choice)) / GIB

    return at, mem


def _lagrangian(p: IntraOpProblem, deadline: float, start: float, steps: int = 12) -> IntraOpSolution | None:
    """The budgeted problem by its Lagrangian relaxation (``pricing.priced_search``: the reductions
    make each priced, unbudgeted solve fast). The fitting assignment of least time is returned
    ("FEASIBLE": a Lagrangian solution need not be the budgeted optimum; its gap is the duality
    gap). None when no price below the forbidden threshold makes it fit (the caller then runs the
    exact model)."""
    at, mem = _priced(p, deadline, start)
    ceiling = HUGE_COST / 10 / max(max((float(m[np.isfinite(m)].max(initial=0.0)) for m in mem), default=0.0), 1e-9)
    try:
        best = priced_search(p.memory_budget / GIB, at, ceiling, deadline, steps)
    except (SolverTimeoutError, InfeasibleError):
        return None
    if best is None:
        return None
    objective, choice, _ = best
    return IntraOpSolution(choice, objective, "FEASIBLE", time.perf_counter() - start, evaluate(p, choice)[1], 0)


def _dual_bound(p: IntraOpProblem, deadline: float, start: float, free: IntraOpSolution) -> Dual:
    """max over the prices tried of L(lam) (docs/solver.md, Bound; ``pricing.dual_bound``). The
    unbudgeted solution ``free`` (time T, memory m over the budget M) bounds L from above, L(lam)
    <= T + lam (m - M), so no price under lam0 = (cutoff - T) / (m - M) can reach the cutoff: the
    prices start at 1.5 lam0, lam0 is the floor of the bisection."""
    at, _ = _priced(p, deadline, start, free.choice)
    over = (free.memory - p.memory_budget) / GIB
    floor = (p.cutoff - free.objective) / over if over > 0 and free.objective < p.cutoff < math.inf else 0.0
    return dual_bound(p.memory_budget / GIB, at, p.cutoff, deadline, stop=(SolverTimeoutError, InfeasibleError),
                      start=1.5 * floor if floor > 0 else 1e-4, floor=floor)


def _no_assignment(p: IntraOpProblem) -> InfeasibleError:
    """Nothing feasible: forbidden choices everywhere (no budget), else the memory explanation."""
    if p.memory_budget is None:
        return InfeasibleError("no strategy assignment avoids forbidden (infinite or >= HUGE_COST) "
                               "compute/resharding choices; check the op rules and annotations")
    return _memory_error(p)


def _class_hint(class_of: list[int], choice: list[int] | None) -> dict[int, int] | None:
    return None if choice is None else {a: s for a, s in zip(class_of, choice)}


__all__ = ["HUGE_COST", "DominatedError", "EdgeCost", "InfeasibleError", "IntraOpProblem", "IntraOpSolution", "NodeChoices",
           "SolverTimeoutError", "evaluate", "solve_free_exact", "solve_intra_op"]
