"""A budget under the memory floor with a cutoff (``intra_op._hopeless``, ``HOPELESS_BOUND``): the
unbudgeted optimum is solved first and, when its proven bound reaches the cutoff, the solve raises
``DominatedError(unbudgeted=True)`` instead of the memory explanation, so the search drops the mesh at
every larger accumulation and recomputation (``search._stops_mesh``) instead of solving it again
there. Below the cutoff, without one, or switched off, the memory explanation is raised as before."""
from __future__ import annotations

import functools

import numpy as np
import pytest

import autopar
from autopar.core.context import ParallelMode
from autopar.frontend.trace import trace
from autopar.solver import intra_op
from autopar.solver.intra_op import (DominatedError, EdgeCost, InfeasibleError, IntraOpProblem, NodeChoices,
                                     solve_intra_op)
from autopar.solver.mesh_solve import PlanOptions, solve_on_mesh
from autopar.solver.request import SolveRequest
from autopar.solver.search import _mark_done
from examples import factories


def _problem(cutoff):
    """Two nodes of two strategies (fast and big, or slow and small) and one edge: the unbudgeted
    optimum takes 2.0 s; the least memory, 6 bytes, is over the 5-byte budget."""
    nodes = [NodeChoices("a", np.array([1.0, 3.0]), np.array([10.0, 3.0])),
             NodeChoices("b", np.array([1.0, 3.0]), np.array([10.0, 3.0]))]
    edges = [EdgeCost(0, 1, np.array([[0.0, 0.5], [0.5, 0.0]]))]
    return IntraOpProblem(nodes, edges, memory_budget=5.0, cutoff=cutoff)


def test_hopeless_budget_over_the_cutoff_is_dominated(monkeypatch):
    monkeypatch.setattr(intra_op, "HOPELESS_BOUND", True)
    with pytest.raises(DominatedError) as got:
        solve_intra_op(_problem(cutoff=1.5))
    assert got.value.unbudgeted and got.value.lower_bound == pytest.approx(2.0)
    for cutoff in (2.5, None):          # the optimum beats the cutoff, or there is none: the memory explanation
        with pytest.raises(InfeasibleError, match="smallest achievable memory is"):
            solve_intra_op(_problem(cutoff))


def test_switched_off_the_hopeless_budget_explains_its_memory(monkeypatch):
    monkeypatch.setattr(intra_op, "HOPELESS_BOUND", False)
    with pytest.raises(InfeasibleError, match="smallest achievable memory is"):
        solve_intra_op(_problem(cutoff=1.5))


@functools.lru_cache(maxsize=None)
def _traced():
    model, inputs, loss, target = factories.gpt(hidden=32, layers=2, heads=2, seq=32, batch=8, vocab=256)
    return model, trace(model, inputs, loss, target)


def _mesh_solve(cutoff: float):
    """A 2-layer GPT on 4 H100s under a 16 KiB cap (its state alone is more): one flat mesh's solve."""
    model, traced = _traced()
    mesh = autopar.Mesh(4, device="h100", memory_gb=2**-16).reshape((2, 2), ("dp", "tp"))
    opts = PlanOptions(memory_budget_gb=2**-16, time_limit_s=60.0)
    return solve_on_mesh(SolveRequest(traced, model, mesh, ParallelMode.AUTO, opts), cutoff=cutoff)


@pytest.mark.slow
def test_a_mesh_that_cannot_fit_or_win_is_dropped_at_every_accumulation(monkeypatch):
    """On and off on the same mesh: on, the solve's DominatedError ends the mesh's frontier from this
    accumulation on (``_mark_done``); off, its InfeasibleError leaves it to be solved at the next k."""
    monkeypatch.setattr(intra_op, "HOPELESS_BOUND", False)
    with pytest.raises(InfeasibleError) as infeasible:
        _mesh_solve(cutoff=1e-9)
    monkeypatch.setattr(intra_op, "HOPELESS_BOUND", True)
    with pytest.raises(DominatedError) as dominated:
        _mesh_solve(cutoff=1e-9)
    assert dominated.value.unbudgeted
    key = ((2, 2), ("dp", "tp"))
    done_off, done_on = {}, {}
    _mark_done(done_off, [], [(autopar.Mesh((2, 2), ("dp", "tp")), infeasible.value)], 0, 5)
    _mark_done(done_on, [], [(autopar.Mesh((2, 2), ("dp", "tp")), dominated.value)], 0, 5)
    assert key not in done_off and done_on[key] == 0
    with pytest.raises(InfeasibleError):            # a cutoff it beats: the memory explanation, as before
        _mesh_solve(cutoff=1e6)


def _frontier_solves(monkeypatch, on: bool, cap_gb: float = 2**-16) -> tuple[int, list]:
    """``search._frontier`` at ZeRO-0, no recomputation, over accumulations 1, 2, 4, 8 of the 2-layer GPT
    on 2 H100s under ``cap_gb``, with a best plan so far (the cutoff) no layout beats: how many flat-mesh
    solves it makes and its failures."""
    from autopar.graph.retrace import Retracer
    from autopar.solver import search
    from autopar.solver.progress import SearchProgress

    monkeypatch.setattr(intra_op, "HOPELESS_BOUND", on)
    model, inputs, loss, target = factories.gpt(hidden=32, layers=2, heads=2, seq=32, batch=8, vocab=256)
    traced = trace(model, inputs, loss, target)
    progress = SearchProgress()
    progress.kept_times = [1e-9]        # a best plan so far that no layout of this job beats
    opts = PlanOptions(memory_budget_gb=cap_gb, time_limit_s=60.0, zero=0, recompute="none", progress=progress)
    req = SolveRequest(traced, model, autopar.Mesh(2, device="h100", memory_gb=cap_gb), ParallelMode.AUTO, opts,
                       retracer=Retracer(model, inputs, loss, target))
    calls, real = [], search.solve_on_mesh
    monkeypatch.setattr(search, "solve_on_mesh", lambda r, *a, **k: calls.append(r.mesh.shape) or real(r, *a, **k))
    plans, failures, _ = search._frontier(req, [1, 2, 4, 8], ["none"], "none", {}, search.FrontierState())
    assert not plans
    return len(calls), failures


@pytest.mark.slow
def test_the_frontier_solves_a_mesh_that_cannot_fit_or_win_once(monkeypatch):
    """Off: the mesh's InfeasibleError at k = 1 sends it to the k its least memory allows, where it is
    solved again; on: dominated at k = 1 (no layout beats the cutoff), it is not solved at any other k.
    The cap: two thirds of the least memory at k = 1, so that k = 2 is not ruled out by it."""
    _, hopeless = _frontier_solves(monkeypatch, False)
    least = min(f.error.least_memory for f in hopeless if getattr(f.error, "least_memory", None))
    cap = least / 1.5 / 2**30
    on, failures_on = _frontier_solves(monkeypatch, True, cap)
    off, failures_off = _frontier_solves(monkeypatch, False, cap)
    assert any(isinstance(f.error, InfeasibleError) for f in failures_off)
    assert not any(isinstance(f.error, InfeasibleError) for f in failures_on)
    assert on < off, (on, off)
