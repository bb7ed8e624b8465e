"""The CP-SAT model of a reduced class graph (``intra_op``'s Variables, Objective, Constraints and
Transients, whose math its docstring gives): one-hot strategy variables per class, the
transportation linearisation of each edge's pairs, the memory row with the workspace beside it."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from autopar.solver.class_graph import ClassGraph, Workspace

_COEF_TARGET = 1e9


@dataclass
class _Model:
    model: cp_model.CpModel
    x: dict[int, list[cp_model.IntVar]]
    num_vars: int
    scale: float = 1.0      # objective units per second
    offset: float = 0.0     # seconds every assignment pays (each class's and edge's least)
    terms: int = 0          # objective terms one assignment sets: one per active class and per edge
    hinted: dict = None     # class -> its hinted position in ``cands``
    hints: tuple = None     # (variable indices, values): the complete hint, written to the model at once


def _scale(g: ClassGraph, active: list[int]) -> float:
    spans = [float(np.ptp(g.compute[a][np.isfinite(g.compute[a])])) for a in active]
    spans += [float(np.ptp(m[np.isfinite(m)])) for m in g.edges.values()]
    largest = max(spans, default=0.0)
    return _COEF_TARGET / largest if largest > 0 else 1.0


def _add_edge_vars(mdl: _Model, a: int, b: int, matrix: np.ndarray, scale: float,
                   kept: np.ndarray | None = None, kept_terms: list | None = None) -> list[tuple]:
    """e[a,b,i,j] with row sums x[a,i] and column sums x[b,j]; returns (var, cost) terms and
    appends (var, bytes) to ``kept_terms`` where the pair keeps bytes (``kept``). Each pair is
    hinted 1 where both ends' hinted positions meet, else 0 (``build_model``: a complete hint)."""
    finite = np.isfinite(matrix)
    ri, ci = np.nonzero(finite)
    low = matrix[finite].min()
    hinted = np.zeros(len(ri), dtype=np.int64)
    if a in mdl.hinted and b in mdl.hinted:
        hinted[(ri == mdl.hinted[a]) & (ci == mdl.hinted[b])] = 1
    pairs = [mdl.model.NewBoolVar(f"e{a}_{b}_{i}_{j}") for i, j in zip(ri.tolist(), ci.tolist())]
    mdl.hints[0].extend(var.Index() for var in pairs)
    mdl.hints[1].extend(hinted.tolist())
    rows: list[list] = [[] for _ in range(matrix.shape[0])]
    cols: list[list] = [[] for _ in range(matrix.shape[1])]
    for i, j, var in zip(ri.tolist(), ci.tolist(), pairs):
        rows[i].append(var)
        cols[j].append(var)
    terms = list(zip(pairs, np.rint((matrix[ri, ci] - low) * scale).astype(np.int64).tolist()))
    if kept is not None and kept_terms is not None:
        kept_terms.extend(zip(pairs, np.asarray(kept, dtype=float)[ri, ci].tolist()))
    for i, vars_ in enumerate(rows):
        mdl.model.Add(cp_model.LinearExpr.Sum(vars_) == mdl.x[a][i])
    for j, vars_ in enumerate(cols):
        mdl.model.Add(cp_model.LinearExpr.Sum(vars_) == mdl.x[b][j])
    mdl.num_vars += len(terms)
    return terms


def _add_memory(mdl: _Model, g: ClassGraph, active: list[int], budget: float, kept: dict,
                work: Workspace | None = None) -> None:
    """sum m x + sum G e (+ sum a x + W) <= budget, in units of 1e-9 of the largest spread,
    memories ceiled, budget floored, workspace floored. ``kept``: edge key -> [(pair variable,
    bytes)] of the edges keeping bytes (``G``; each edge's smallest allowed pair is in the base).
    ``work``: the workspace terms (docs/solver.md, Transients)."""
    work = work or Workspace()
    low = {key: min(b for _, b in pairs) for key, pairs in kept.items() if pairs}
    base = g.fixed_memory + sum(float(g.memory[a].min()) for a in g.alive) + sum(low.values())
    least = max([work.floor] + [float(t.min()) for t in work.peak.values()])     # W's floor: every pick has it
    peak = {a: t for a, t in work.peak.items() if a in mdl.x and float(t.max()) > least}  # others never bind
    added = {a: t for a, t in work.added.items() if a in mdl.x}
    spread = max([float(np.ptp(g.memory[a])) for a in active]
                 + [max(b for _, b in pairs) - low[key] for key, pairs in kept.items() if pairs]
                 + [float(t.max()) for t in [*peak.values(), *added.values()]] + [work.floor], default=0.0)
    if base > budget:
        raise OverBudget(base)
    if spread == 0:
        return
    unit = spread / _COEF_TARGET
    room = math.floor((budget - base) / unit)
    terms = [(x, math.ceil((m - g.memory[a].min()) / unit)) for a in active for x, m in zip(mdl.x[a], g.memory[a])]
    terms += [(e, math.ceil((b - low[key]) / unit)) for key, pairs in kept.items() for e, b in pairs]
    terms += [(x, math.floor(b / unit)) for a, t in added.items() for x, b in zip(mdl.x[a], t)]
    row = _weighted(terms)
    if peak or least > 0:
        lo, hi = min(math.floor(least / unit), max(room, 0)), max(room, 0)
        w = mdl.model.NewIntVar(lo, hi, "workspace")
        for a, t in peak.items():
            mdl.model.Add(w >= sum(math.floor(b / unit) * x for x, b in zip(mdl.x[a], t) if b >= unit))
        mdl.model.AddHint(w, min(max([lo] + [math.floor(t[mdl.hinted[a]] / unit) for a, t in peak.items()
                                             if t[mdl.hinted[a]] >= unit]), hi))
        row = row + w
    mdl.model.Add(row <= room - math.ceil(work.fixed / unit))


def _weighted(terms: list[tuple]):
    """sum c x over the terms with c != 0 (0 when none)."""
    kept = [(x, c) for x, c in terms if c]
    return cp_model.LinearExpr.WeightedSum([x for x, _ in kept], [c for _, c in kept]) if kept else 0


class OverBudget(Exception):
    def __init__(self, lower_bound: float):
        super().__init__(lower_bound)
        self.lower_bound = lower_bound


def active_classes(g: ClassGraph) -> list[int]:
    """Classes left with a choice to make (or an edge to pay)."""
    return sorted(a for a in g.alive if len(g.cands[a]) > 1 or g.nbrs[a])


def workspace_of(g: ClassGraph) -> Workspace:
    """The budget's workspace terms from the classes' (``ClassGraph.workspace``): the active classes'
    per candidate; the least of those the reductions fixed or removed (a removed class picks
    among its remaining candidates)."""
    work = Workspace()
    active = set(active_classes(g))
    for a, w in g.workspace.items():
        if a in active:
            work.added[a], work.peak[a] = w[:, 0], w[:, 1]
        else:
            work.fixed += float(w[:, 0].min())
            work.floor = max(work.floor, float(w[:, 1].min()))
    return work


def build_model(g: ClassGraph, budget: float | None, hint: dict[int, int] | None = None,
                 work: Workspace | None = None, ceiling: float | None = None) -> tuple[_Model, list[int]]:
    """CP-SAT model of the reduced graph; ``hint`` maps classes to original strategy indices;
    ``work``: the workspace beside the memory row (budgeted only); ``ceiling`` (seconds): only
    assignments that may be faster are kept (``_add_ceiling``), so INFEASIBLE proves none is."""
    active = active_classes(g)
    mdl = _Model(cp_model.CpModel(), {}, 0, hinted={}, hints=([], []))
    for a in active:
        mdl.x[a] = [mdl.model.NewBoolVar(f"x{a}_{s}") for s in g.cands[a]]
        mdl.model.AddExactlyOne(mdl.x[a])
        hinted = np.flatnonzero(g.cands[a] == hint[a]) if hint is not None else []
        mdl.hinted[a] = int(hinted[0]) if len(hinted) else int(np.argmin(g.compute[a]))
        mdl.hints[0].extend(x.Index() for x in mdl.x[a])
        mdl.hints[1].extend(int(s == mdl.hinted[a]) for s in range(len(mdl.x[a])))
        mdl.num_vars += len(mdl.x[a])
    scale = _scale(g, active)
    terms = [(x, int(round((c - g.compute[a].min()) * scale))) for a in active for x, c in zip(mdl.x[a], g.compute[a])]
    kept: dict[tuple[int, int], list] = {}
    for (a, b), m in g.edges.items():
        mem = g.edge_memory.get((a, b)) if budget is not None else None
        terms += _add_edge_vars(mdl, a, b, m, scale, mem, kept.setdefault((a, b), []) if mem is not None else None)
    if budget is not None:
        _add_memory(mdl, g, active, budget, kept, work)
    mdl.model.Proto().solution_hint.vars.extend(mdl.hints[0])
    mdl.model.Proto().solution_hint.values.extend(mdl.hints[1])
    objective = _weighted(terms)
    mdl.model.Minimize(objective)
    mdl.scale, mdl.terms = scale, len(active) + len(g.edges)
    mdl.offset = sum(float(g.compute[a].min()) for a in g.alive) + sum(float(m[np.isfinite(m)].min())
                                                                       for m in g.edges.values())
    if ceiling is not None:
        _add_ceiling(mdl, objective, ceiling)
    return mdl, active


def _add_ceiling(mdl: _Model, objective, ceiling: float) -> None:
    """objective <= (ceiling - offset) scale + terms / 2: an assignment of fewer seconds than
    ``ceiling`` has a scaled objective of at most that (each of its ``terms`` coefficients was
    rounded by at most half a unit), so the row removes only assignments at least as slow."""
    limit = (ceiling - mdl.offset) * mdl.scale + mdl.terms / 2
    if limit < 0:
        mdl.model.AddBoolOr([])         # nothing can be that fast: an empty clause, INFEASIBLE
    elif limit < 2 ** 62 and not isinstance(objective, int):
        mdl.model.Add(objective <= math.floor(limit))


def objective_bound(mdl: _Model, solver: cp_model.CpSolver) -> float:
    """A proven lower bound (seconds) on the reduced graph's optimum, from CP-SAT's bound on the
    scaled objective: each of the ``terms`` coefficients an assignment sets was rounded by at
    most half a unit, so the seconds are at least (bound - terms / 2) / scale above the offset.
    The reductions are exact, so it bounds the whole problem's optimum too."""
    return mdl.offset + (solver.BestObjectiveBound() - mdl.terms / 2) / mdl.scale


class _GoodEnough(cp_model.CpSolverSolutionCallback):
    """Stops the search at the first solution whose seconds are at most ``target``."""

    def __init__(self, mdl: _Model, target: float):
        super().__init__()
        self._mdl, self._target = mdl, target

    def on_solution_callback(self) -> None:
        if self._mdl.offset + (self.ObjectiveValue() + self._mdl.terms / 2) / self._mdl.scale <= self._target:
            self.StopSearch()


# The workers of a small solve: the default search with its LP, one with the strongest LP
# relaxation (linearization level 2: the lower bound that proves the optimum) and the unsat-core
# search (raises the bound from below). CP-SAT's own choice for 2 workers leaves the last two out.
PORTFOLIO = ("default_lp", "max_lp", "core")
# A large model (more variables than this) is presolved without probing and stops within ``GAP`` of
# its bound. On the 43k-86k-variable budgeted models of a two-axis mesh (49 strategies a class, 49 x 49
# pairs an edge; the tied layers' classes) three probing rounds took ~3 s of a 4.6 s presolve and the
# search from the complete hint reached the optimum sooner without them; the last 0.03 % of the gap
# then took 3-6 s of 6-9 s runs. Smaller models keep CP-SAT's defaults and are proven as before.
LARGE_VARS = 20_000
# CP-SAT's relative gap, |objective - bound| / |objective| of the scaled objective. Every class's and
# edge's least time is shifted out of that objective (``_Model.offset`` >= 0), so the seconds are
# within GAP of the optimum too: (offset + o) / (offset + b) <= o / b for o >= b > 0.
GAP = 1e-3


def run_model(mdl: _Model, time_limit_s: float, workers: int,
              good_enough: float | None = None) -> tuple[cp_model.CpSolver, int]:
    """Solve until optimal, out of time, (a large model) within ``GAP`` of the proven bound, or
    (``good_enough``, seconds) a solution at most that slow (its seconds over-estimated by the rounding,
    as ``objective_bound`` under-estimates them). A run stopped by the gap returns FEASIBLE, not OPTIMAL."""
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = max(workers, len(PORTFOLIO))
    if workers <= len(PORTFOLIO):
        solver.parameters.subsolvers.extend(PORTFOLIO)
    solver.parameters.random_seed = 0
    # CP-SAT 9.15's at-most-one x linear inclusion presolve certifies wrong optima on exactly
    # this model shape (one-hot rows + memory row): google/or-tools#5293. 0 switches it off.
    solver.parameters.presolve_inclusion_work_limit = 0
    if mdl.num_vars > LARGE_VARS:
        solver.parameters.cp_model_probing_level = 0
        solver.parameters.relative_gap_limit = GAP
    status = solver.Solve(mdl.model) if good_enough is None else solver.Solve(mdl.model, _GoodEnough(mdl, good_enough))
    if status == cp_model.OPTIMAL and solver.BestObjectiveBound() < solver.ObjectiveValue():
        status = cp_model.FEASIBLE      # stopped by the gap: not proven
    return solver, status


def picked_strategies(g: ClassGraph, mdl: _Model, active: list[int], solver: cp_model.CpSolver) -> dict[int, int]:
    picked = {a: int(g.cands[a][0]) for a in g.alive}
    for a in active:
        picked[a] = int(g.cands[a][next(s for s, x in enumerate(mdl.x[a]) if solver.Value(x))])
    return picked
