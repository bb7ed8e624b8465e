"""Pipelines retried with more recomputation once a plan fits (``search._note_retries``, ``_retries``):
those whose stage cut the cap shaped or that were refused for memory with room for their state, while
their step without the cap beats the best plan so far."""
from __future__ import annotations

import types

from autopar.core.mesh import Mesh
from autopar.plan.plan import PipelineInfo
from autopar.solver.pipeline_fit import PipelineDominatedError
from autopar.solver.search import FrontierState, _note_retries, _retries

SHALLOW = ((16, 128, 4), ("pp", "dp", "tp"))
DEEP = ((32, 32, 8), ("pp", "dp", "tp"))
TINY = ((2, 512, 8), ("pp", "dp", "tp"))


def _plan(key, bound: bool, free: float):
    mesh = Mesh(key[0], key[1])
    return types.SimpleNamespace(mesh=mesh, memory_bound=bound,
                                 pipeline=PipelineInfo(microbatch_size=1, microbatch_fingerprint="", free_step=free))


def _refused(key, free=None, kind=ValueError):
    err = kind("no pipeline partition fits")
    err.full_key = key
    if free is not None:
        err.free_step = free
    return ("note", err)


def test_shaped_and_refused_pipelines_are_kept_with_their_free_step():
    state = FrontierState()
    _note_retries(state, [_plan(DEEP, True, 17.0)], [_refused(SHALLOW, 14.5), _refused(TINY)])
    assert state.retry == {DEEP: 17.0, SHALLOW: 14.5}     # TINY: its state does not fit (no free step)


def test_only_those_under_the_best_plan_are_retried():
    state = FrontierState(retry={DEEP: 17.0, SHALLOW: 14.5})
    assert _retries(state, 18.49) == {DEEP, SHALLOW}
    assert _retries(state, 15.0) == {SHALLOW}
    assert _retries(state, 14.0) == set()
    assert _retries(state, None) == {DEEP, SHALLOW}


def test_a_pipeline_that_fits_freely_or_loses_leaves_the_list():
    state = FrontierState(retry={DEEP: 17.0, SHALLOW: 14.5})
    _note_retries(state, [_plan(DEEP, False, 16.0)], [_refused(SHALLOW, kind=PipelineDominatedError)])
    assert state.retry == {}


def test_a_meshes_plan_is_not_a_pipeline_retry():
    state = FrontierState()
    flat = types.SimpleNamespace(mesh=Mesh((4, 2), ("dp", "tp")), memory_bound=True, pipeline=None)
    _note_retries(state, [flat], [("mesh (4, 2)", ValueError("x"))])
    assert state.retry == {}


# ---- floors handed from ZeRO-1 to the higher stages (``search._share_floors``) ----------------

def test_zero1_floors_reach_the_higher_stages_and_zero0_floors_reach_zero1_halved(monkeypatch):
    """A ZeRO-1 floor holds under ZeRO-2 and -3 as it is; a ZeRO-0 floor F gives ZeRO-1 only F / 2 - S
    (``zero_floor``: ZeRO-1 may be faster than ZeRO-0), and nothing where that is not positive."""
    import types

    from autopar.solver import search
    from autopar.solver.search import _share_floors
    monkeypatch.setattr(search, "zero1_slack", lambda traced, shape, mesh, opts: 3.0)
    req = types.SimpleNamespace(traced=None, mesh=None, opts=None)
    key, low = ((8, 1024), ("dp", "tp")), ((16, 512), ("dp", "tp"))
    frontiers = {z: FrontierState() for z in (0, 1, 2, 3)}
    frontiers[0].floors[key] = [(0, 30.0)]
    frontiers[0].floors[low] = [(0, 5.0)]
    _share_floors(0, frontiers[0], frontiers, req)
    assert frontiers[1].floors[key] == [(0, 12.0)] and not frontiers[1].floors[low]
    assert not frontiers[2].floors and not frontiers[3].floors
    frontiers[1].floors[key] = [(0, 25.0)]
    _share_floors(1, frontiers[1], frontiers, req)
    _share_floors(1, frontiers[1], frontiers, req)             # idempotent
    assert frontiers[2].floors[key] == [(0, 25.0)] and frontiers[3].floors[key] == [(0, 25.0)]
    assert frontiers[0].floors[key] == [(0, 30.0)]


def test_zero2_and_zero1_cost_a_layout_the_same_and_zero3_more():
    """The premise of the hand-over, on the cost model itself: one parameter's step terms at one
    microbatch under ZeRO-1, -2 and -3."""
    import torch
    from autopar.cost_models.devices import get_device
    from autopar.sharding.placements import R
    from autopar.sharding.strategy import Strategy
    from autopar.solver.strategy_prices import Costing, _param_state_cost
    st = Strategy((), (R, R), (None, None), "replicate")
    times = {}
    for z in (1, 2, 3):
        c = Costing((4, 2), get_device("h100"), "adamw", "bf16", zero=z)
        _, seconds, _ = _param_state_cost(1 << 20, [2.0 * (1 << 20), 4.0 * (1 << 20), 12.0 * (1 << 20)], st, c)
        times[z] = seconds
    assert times[2] == times[1] and times[3] > times[2]


def test_beaten_lists_every_mesh_whose_floor_reaches_the_best_plan_done_or_not():
    """The batch rule reads a merged mesh that is not solved again (its floor handed over from ZeRO-1)
    as beaten: its cp mesh is then not solved either."""
    from autopar.solver.intra_op import DominatedError
    from autopar.solver.search import _beaten
    merged, other = ((1024, 8), ("dp", "tp")), ((2, 4096), ("dp", "tp"))
    state = FrontierState(floors={merged: [(0, 25.0)], other: [(0, 12.0), (1, 19.0)]}, done={merged: 0})
    got = _beaten(state, 0, 18.49)
    assert set(got) == {merged} and isinstance(got[merged], DominatedError) and got[merged].unbudgeted
    assert set(_beaten(state, 1, 18.49)) == {merged, other}     # a floor proven at a later index counts there
    assert _beaten(state, 0, None) == {}


# ---- the ZeRO-1 probe on a pipeline the ZeRO-1 frontier did not try (``zero_upgrade.applies``) --------

def test_zero1_probe_runs_for_a_pipeline_the_zero1_frontier_did_not_try():
    from autopar.core.context import ParallelMode
    from autopar.plan.plan import MemoryOptions
    from autopar.solver.mesh_solve import PlanOptions
    from autopar.solver.search import _pipeline_tried
    from autopar.solver.zero_upgrade import applies
    best = _plan(SHALLOW, False, 7.6)
    best.memory_options = MemoryOptions(recompute="full")
    zero1 = FrontierState(pipes={(SHALLOW, "none"), (DEEP, "full")})
    assert not _pipeline_tried(best, zero1) and not _pipeline_tried(best, None)
    zero1.pipes.add((SHALLOW, "full"))
    assert _pipeline_tried(best, zero1)
    req = types.SimpleNamespace(opts=PlanOptions(), mode=ParallelMode.AUTO, mesh=Mesh((16, 128, 8)))
    assert applies(req, {0}) and applies(req, {0, 1}, best_tried=False)
    assert not applies(req, {0, 1}, best_tried=True)


# ---- a pipeline's partial-recomputation probes keep its layout (``partial_recompute._pinned``) --------

def test_pipeline_probes_pin_the_best_layouts_parameters_off_the_pp_axis():
    from autopar.plan.plan import ParamDecision
    from autopar.sharding.placements import R, Shard, Spec
    from autopar.solver.partial_recompute import _pinned
    best = types.SimpleNamespace(mesh=Mesh((4, 2, 2), ("pp", "dp", "tp")), params={
        "w": ParamDecision(Spec((R, R, Shard(0))), [8, 8], "float32", "p_w"),
        "running_mean": ParamDecision(Spec((R, R, R)), [8], "float32", "b_rm", kind="buffer")})
    assert _pinned(best) == {"w": {"dp": R, "tp": Shard(0)}}
