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
