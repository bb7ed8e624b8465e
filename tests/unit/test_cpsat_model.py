"""The CP-SAT model's hint, gap and presolve settings (solver/cpsat_model.py)."""
import itertools

import numpy as np
import pytest
from ortools.sat.python import cp_model

from autopar.solver import cpsat_model, elimination, exhaustive, intra_op
from autopar.solver.brute_force import brute_force
from autopar.solver.cpsat_model import active_classes, build_model, run_model, workspace_of
from autopar.solver.intra_op import evaluate, replace, solve_intra_op, workspace_bytes

from tests.unit.test_solver_intra_op import random_problem, with_edge_memory


def _with_transients(p, rng):
    """``p`` with a max and a sum workspace term on some nodes (intra_op, Transients)."""
    peak = [rng.uniform(0, 0.5, len(n.compute)) if rng.random() < 0.5 else None for n in p.nodes]
    added = [rng.uniform(0, 0.2, len(n.compute)) if rng.random() < 0.3 else None for n in p.nodes]
    return replace(p, transient=(peak, added))


def _fitting_assignment(p, rng):
    """A random finite assignment (ties respected); the budget set just above its memory and workspace."""
    roots = intra_op._tie_classes(p)
    picks = {}
    for _ in range(50):
        for r in dict.fromkeys(roots):
            allowed = p.nodes[r].allowed or range(len(p.nodes[r].compute))
            picks[r] = int(rng.choice(list(allowed)))
        choice = [picks[r] for r in roots]
        if all(p.nodes[v].allowed is None or s in p.nodes[v].allowed for v, s in enumerate(choice)):
            objective, memory = evaluate(p, choice)
            if np.isfinite(objective):
                total = memory + workspace_bytes(p, choice)
                return choice, replace(p, memory_budget=total * (1 + 1e-6) + 1e-9)
    return None, p


@pytest.mark.parametrize("seed", range(30))
def test_the_hint_is_complete_and_the_model_accepts_it(seed):
    """Every variable of the budgeted model is hinted (one-hot rows, edge pairs, the workspace), and
    the hint of a fitting assignment is a solution of the model with that assignment's seconds: CP-SAT
    starts its search from it instead of completing a partial hint (which on 43k-86k-variable models
    found nothing in 10 s)."""
    rng = np.random.default_rng(seed)
    p = _with_transients(with_edge_memory(random_problem(rng), rng), rng)
    choice, p = _fitting_assignment(p, rng)
    if choice is None:
        return
    g, class_of = intra_op._collapse_ties(p)
    intra_op._map_edges(p, g, class_of)         # unreduced: the hinted strategies are all candidates
    if not active_classes(g):
        return
    mdl, active = build_model(g, p.memory_budget, hint=intra_op._class_hint(class_of, choice), work=workspace_of(g))
    proto = mdl.model.Proto()
    assert sorted(proto.solution_hint.vars) == list(range(len(proto.variables)))
    solver = cp_model.CpSolver()
    solver.parameters.fix_variables_to_their_hinted_value = True
    solver.parameters.max_time_in_seconds = 10
    assert solver.Solve(mdl.model) in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    picked = cpsat_model.picked_strategies(g, mdl, active, solver)
    assert [picked[a] for a in class_of] == choice
    seconds = mdl.offset + solver.ObjectiveValue() / mdl.scale
    assert seconds == pytest.approx(evaluate(p, choice)[0], abs=1e-6)


def test_a_run_stopped_by_the_gap_is_feasible_not_optimal(monkeypatch):
    """``GAP`` (a large model): CP-SAT stops within that share of its bound and calls it OPTIMAL; ``run_model`` returns
    FEASIBLE unless the bound meets the objective, so a solve says OPTIMAL only when proven, and what
    comes back is within the gap of brute force's optimum. Under a wide gap some random problems stop
    early (the test fails if none does)."""
    monkeypatch.setattr(exhaustive, "LIMIT", 0)
    monkeypatch.setattr(elimination, "LIMIT", 0)
    monkeypatch.setattr(cpsat_model, "GAP", 0.5)
    monkeypatch.setattr(cpsat_model, "LARGE_VARS", 0)
    early = 0
    for seed in range(40):
        p = replace(random_problem(np.random.default_rng(seed)), memory_budget=None)
        best = brute_force(p).objective
        got = solve_intra_op(p)
        assert got.lower_bound <= best + 1e-9 and got.objective <= best * 1.5 + 1e-9
        if got.status == "OPTIMAL":
            assert got.objective == pytest.approx(best, abs=1e-6)
        early += got.status == "FEASIBLE"
    assert early, "no run stopped at the gap: the test no longer checks the status"


def test_large_models_are_presolved_without_probing_and_stop_at_the_gap(monkeypatch):
    """A model with more than ``LARGE_VARS`` variables runs with CP-SAT's probing off and the gap
    limit; a smaller one keeps CP-SAT's defaults (proven as before)."""
    seen = []
    real = cp_model.CpSolver.Solve

    def spy(self, model, *args):
        seen.append((self.parameters.cp_model_probing_level, self.parameters.relative_gap_limit))
        return real(self, model, *args)

    monkeypatch.setattr(cp_model.CpSolver, "Solve", spy)
    g, _ = _chain(3, 4)
    mdl, _ = build_model(g, None)
    for limit in (mdl.num_vars, mdl.num_vars - 1, mdl.num_vars + 1):
        monkeypatch.setattr(cpsat_model, "LARGE_VARS", limit)
        run_model(mdl, 5.0, 1)
    default = (cp_model.CpSolver().parameters.cp_model_probing_level, cp_model.CpSolver().parameters.relative_gap_limit)
    assert seen == [default, (0, cpsat_model.GAP), default] and default[1] < cpsat_model.GAP


def _chain(n: int, k: int):
    """A class graph of ``n`` classes of ``k`` candidates, each joined to the next and to every other."""
    from autopar.solver.class_graph import ClassGraph
    rng = np.random.default_rng(0)
    g = ClassGraph(members=[[a] for a in range(n)], cands=[np.arange(k) for _ in range(n)],
                   compute=[rng.uniform(0, 1, k) for _ in range(n)], memory=[np.zeros(k) for _ in range(n)],
                   nbrs=[set() for _ in range(n)], alive=set(range(n)))
    for a, b in itertools.combinations(range(n), 2):
        g.add_edge(a, b, rng.uniform(0, 1, (k, k)))
    return g, None
