"""Each mesh solve's unbudgeted floor (``Plan.step_floor``, an error's ``step_floor``) drops the mesh at
later accumulations and recomputation once the best plan reaches it (``search._floored``): no layout of
the mesh beats the floor at any budget, and the unbudgeted bound only grows with k and recomputation. A
mesh whose floor is under the best plan is still solved there (a larger k may let a faster layout fit)."""
from __future__ import annotations

import functools

import pytest

import autopar
from autopar.core.context import ParallelMode
from autopar.frontend.trace import trace
from autopar.solver import intra_op, search
from autopar.solver.intra_op import DominatedError, InfeasibleError
from autopar.solver.mesh_solve import PlanOptions, solve_on_mesh
from autopar.solver.request import SolveRequest
from autopar.solver.search import FrontierState, _floored, _mark_done
from examples import factories

KEY = ((2, 2), ("dp", "tp"))


def _state(*proven) -> FrontierState:
    state = FrontierState()
    state.floors[KEY] = list(proven)
    return state


def test_a_floor_at_the_best_plan_drops_the_mesh_from_that_index_on():
    state = _state((0, 0.7))
    got = _floored(state, 2, 0.57, "accumulation 4")
    assert state.done[KEY] == 2
    assert len(got) == 1 and isinstance(got[0][1], DominatedError) and got[0][1].unbudgeted
    assert got[0][1].lower_bound == 0.7 and "accumulation 4" in got[0][0]


def test_a_floor_under_the_best_plan_leaves_the_mesh_to_be_solved():
    """The case the bound must not lose: a mesh that did not fit (or fitted only shaped by the cap) whose
    floor is under the best plan may win at a larger k, so it is solved there."""
    state = _state((0, 0.5))
    assert _floored(state, 1, 0.57, "") == [] and KEY not in state.done


def test_a_floor_proven_at_a_larger_k_says_nothing_about_a_smaller_one():
    state = _state((3, 0.9))                  # proven at k index 3 (e.g. by an earlier recompute choice)
    assert _floored(state, 1, 0.57, "") == [] and KEY not in state.done
    assert _floored(state, 3, 0.57, "") and state.done[KEY] == 3


def test_no_cutoff_or_switched_off_drops_nothing(monkeypatch):
    state = _state((0, 0.7))
    assert _floored(state, 1, None, "") == [] and KEY not in state.done
    monkeypatch.setattr(search, "STEP_FLOORS", False)
    assert _floored(state, 1, 0.57, "") == [] and KEY not in state.done


def test_mark_done_records_the_floors_of_plans_and_errors():
    floors: dict = {}
    mesh = autopar.Mesh((2, 2), ("dp", "tp"))
    plan = autopar.Plan(mode=ParallelMode.AUTO, mesh=mesh, degrees={}, memory_bound=True, step_floor=0.4, step_time=0.6)
    err = InfeasibleError("over")
    err.step_floor = 0.45
    unproven = InfeasibleError("over")          # no floor (a timed-out free solve): nothing recorded
    done: dict = {}
    _mark_done(done, [plan], [(mesh, err), (autopar.Mesh(4).reshape((4,), ("d0",)), unproven)], 1, 5, floors)
    assert floors == {KEY: [(1, 0.4), (1, 0.45)]} and done == {}


@functools.lru_cache(maxsize=None)
def _traced():
    model, inputs, loss, target = factories.gpt(hidden=32, layers=2, heads=2, seq=32, batch=8, vocab=256)
    return model, trace(model, inputs, loss, target)


def _solve(cap_gb: float | None, cutoff: float | None, microbatches: int = 1):
    model, traced = _traced()
    mesh = autopar.Mesh(4, device="h100").reshape((2, 2), ("dp", "tp"))
    opts = PlanOptions(memory_budget_gb=cap_gb, time_limit_s=60.0)
    return solve_on_mesh(SolveRequest(traced, model, mesh, ParallelMode.AUTO, opts), microbatches=microbatches,
                         cutoff=cutoff)


def test_a_mesh_solve_reports_its_unbudgeted_floor():
    """The floor is the whole step's unbudgeted optimum: the free plan's time less its last gradient
    bucket (added after the solve); at accumulation k, k x the per-step problem's optimum."""
    roomy = _solve(80.0, None)
    assert not roomy.memory_bound
    assert roomy.step_floor == pytest.approx(roomy.step_time - roomy.grad_sync_overhead, rel=1e-6)
    two = _solve(80.0, None, microbatches=2)    # the plan's time is one microbatch's (``accumulated_time``)
    whole = search.accumulated_time(two, 2)
    assert two.step_floor == pytest.approx(whole - two.grad_sync_overhead, rel=1e-6)


def test_an_infeasible_mesh_under_a_cutoff_carries_its_floor(monkeypatch):
    """Under the memory floor with a cutoff the unbudgeted optimum is solved (``intra_op._hopeless``): the
    error carries it as the step's floor, the cutoff it beats notwithstanding."""
    monkeypatch.setattr(intra_op, "HOPELESS_BOUND", True)
    roomy = _solve(80.0, None)
    with pytest.raises(InfeasibleError) as got:
        _solve(2**-16, cutoff=10.0)
    assert got.value.step_floor == pytest.approx(roomy.step_floor, rel=1e-6)
    with pytest.raises(DominatedError):         # a cutoff under the floor: dropped for good, as before
        _solve(2**-16, cutoff=roomy.step_floor / 2)
