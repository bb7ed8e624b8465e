"""The cutoff of a pipeline candidate's sub-mesh solves (``pipeline_search.whole_step_cutoff``): a
layout whose whole step T over m microbatches is proven at least pp x (1 + margin) x the best plan is
dropped before its budgeted solve ends, since any partition of it into pp ranks runs at least T / pp."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

import autopar
import autopar.solver.pipeline_search as pipeline_search
from autopar.core.context import ParallelMode
from autopar.frontend.trace import trace
from autopar.graph.retrace import Retracer
from autopar.plan.plan import PlanError
from autopar.solver.accumulation import accumulated_time
from autopar.solver.pipeline_fit import PipelineDominatedError, PipelineRequestError
from autopar.solver.pipeline_search import REFERENCE_MARGIN, pipeline_candidates, plan_pipeline, whole_step_cutoff
from autopar.solver.progress import SearchProgress
from autopar.solver.request import PlanOptions
from examples import factories

BUDGET = PlanOptions(memory_budget_gb=0.03)
TIGHT = PlanOptions(memory_budget_gb=0.005)     # binds: the whole-model layouts are budgeted solves


def _setup(mesh):
    model, inputs, loss, target = factories.gpt(hidden=64, layers=4, heads=4, seq=64, batch=16, vocab=2048)
    traced = trace(model, inputs, loss, target)
    cands, _ = pipeline_candidates(traced, mesh, ParallelMode.AUTO, {})
    return traced, Retracer(model, inputs, loss, target), cands


def _recording(monkeypatch):
    """Every sub-mesh solve of the pipeline search: (microbatches, cutoff, plan or error)."""
    calls = []
    real = pipeline_search.solve_on_mesh

    def solve(req, microbatches=1, cutoff=None, **kw):
        try:
            plan = real(req, microbatches, cutoff, **kw)
        except Exception as err:
            calls.append((microbatches, cutoff, err))
            raise
        calls.append((microbatches, cutoff, plan))
        return plan
    monkeypatch.setattr(pipeline_search, "solve_on_mesh", solve)
    return calls


def _planned(traced, retracer, cands, opts: PlanOptions, calls: list):
    """(candidate, plan) of each candidate that gives a plan, ``calls`` holding its own solves."""
    for cand in cands:
        del calls[:]
        try:
            yield cand, plan_pipeline(traced, cand, ParallelMode.AUTO, opts, {}, {}, retracer)
        except (PipelineRequestError, PlanError):
            continue


def _with_best(opts: PlanOptions, best: float) -> PlanOptions:
    progress = SearchProgress()
    progress.kept_times = [best]
    return replace(opts, progress=progress)


@pytest.mark.parametrize("opts", [BUDGET, TIGHT], ids=["loose", "tight"])
def test_a_partition_runs_at_least_its_layouts_whole_step_over_the_stages(monkeypatch, opts):
    """The inequality the cutoff rests on: the finished plan's step >= T(m) / pp of the layout it was cut
    from (every candidate of a small GPT on 4 H100s, under a budget that binds or not)."""
    traced, retracer, cands = _setup(autopar.Mesh(4, device="h100", gpus_per_node=2))
    calls = _recording(monkeypatch)
    checked = 0
    for cand, plan in _planned(traced, retracer, cands, opts, calls):
        layouts = [p for m, _, p in calls if m == plan.microbatches and isinstance(p, autopar.Plan)]
        whole = accumulated_time(layouts[-1], plan.microbatches)
        assert plan.step_time * cand.pp >= whole * (1 - 1e-9), (cand.pp, cand.sub.shape, plan.step_time, whole)
        checked += 1
    assert checked >= 2


def test_a_candidate_whose_layout_cannot_come_near_the_best_plan_is_dropped_in_its_solve(monkeypatch):
    """Under a budget that binds, the solve itself proves the layout too slow (``DominatedError``) and
    the candidate is dropped without its partition; the sub-mesh solve got pp x (1 + margin) x the best."""
    traced, retracer, cands = _setup(autopar.Mesh(4, device="h100", gpus_per_node=2))
    calls = _recording(monkeypatch)
    for cand, plan in _planned(traced, retracer, cands, TIGHT, calls):
        if calls[0][2].memory_bound:
            break
    else:
        pytest.fail("no candidate whose whole-model layout the budget shapes")
    assert all(cutoff is None for _, cutoff, _ in calls)       # no plan so far: no cutoff
    best = plan.step_time / 50
    del calls[:]
    with pytest.raises(PipelineDominatedError) as info:
        plan_pipeline(traced, cand, ParallelMode.AUTO, _with_best(TIGHT, best), {}, {}, retracer)
    msg = str(info.value)
    assert f"slower than the best plan so far ({best:.4g} s): its whole-model layout at" in msg
    assert f"over {cand.pp} stages (over {1 + REFERENCE_MARGIN:g}x; not partitioned)" in msg
    assert len(calls) == 1
    m, cutoff, got = calls[0]
    assert cutoff > cand.pp * (1 + REFERENCE_MARGIN) * best        # room for fewer launches at fewer microbatches
    assert type(got).__name__ == "DominatedError" or accumulated_time(got, m) >= cutoff, got


def test_a_cutoff_the_candidate_beats_leaves_its_plan_as_it_was(monkeypatch):
    traced, retracer, cands = _setup(autopar.Mesh(4, device="h100", gpus_per_node=2))
    for cand in cands:
        try:
            plain = plan_pipeline(traced, cand, ParallelMode.AUTO, TIGHT, {}, {}, retracer)
        except (PipelineRequestError, PlanError):
            continue
        cut = plan_pipeline(traced, cand, ParallelMode.AUTO, _with_best(TIGHT, plain.step_time * 1.001), {}, {},
                            retracer)
        assert (cut.microbatches, cut.schedule, cut.step_time) == (plain.microbatches, plain.schedule,
                                                                   plain.step_time)


def test_no_cutoff_without_a_finite_best_plan():
    assert whole_step_cutoff(None, 4) is None
    assert whole_step_cutoff(math.inf, 4) is None
    assert whole_step_cutoff(2.0, 4) == pytest.approx(4 * (1 + REFERENCE_MARGIN) * 2.0)


def test_a_solve_that_proves_the_cutoff_drops_the_candidate_with_its_bound(monkeypatch):
    """The sub-mesh solve's own proof (``DominatedError``: the budgeted bound reaches the cutoff) drops
    the candidate, naming the bound as a whole step and over the stages."""
    from autopar.solver.intra_op import DominatedError

    traced, retracer, cands = _setup(autopar.Mesh(4, device="h100", gpus_per_node=2))
    cand = cands[-1]

    given = []

    def proven(req, microbatches=1, cutoff=None, **kw):
        given.append(cutoff)
        raise DominatedError(cutoff / microbatches * 1.5, cutoff / microbatches, unbudgeted=False)
    monkeypatch.setattr(pipeline_search, "solve_on_mesh", proven)
    with pytest.raises(PipelineDominatedError) as info:
        plan_pipeline(traced, cand, ParallelMode.AUTO, _with_best(TIGHT, 2.0), {}, {}, retracer)
    whole = given[0] * 1.5
    assert given[0] >= cand.pp * (1 + REFERENCE_MARGIN) * 2.0
    assert f"takes at least {whole:.4g} s a step on the sub-mesh, so at least {whole / cand.pp:.4g} s over " \
           f"{cand.pp} stages" in str(info.value)


def test_the_launch_room_covers_every_layouts_unit_launches(monkeypatch):
    """``launch_seconds`` of a microbatch trace is at least the launches its units keep whole in any
    layout the search solves (``UnitCosts.launch``), so the reference's room for fewer microbatches holds."""
    from autopar.solver.unit_costs import launch_seconds
    traced, retracer, cands = _setup(autopar.Mesh(4, device="h100", gpus_per_node=2))
    seen = []
    real = pipeline_search.unit_profiles

    def profiles(mb, plan, units, unit_of, device, opts):
        costs = real(mb, plan, units, unit_of, device, opts)
        seen.append((launch_seconds(mb, device), sum(costs.launch)))
        return costs
    monkeypatch.setattr(pipeline_search, "unit_profiles", profiles)
    for cand in cands:
        try:
            plan_pipeline(traced, cand, ParallelMode.AUTO, TIGHT, {}, {}, retracer)
        except (PipelineRequestError, PlanError):
            pass
    assert seen and all(room >= kept * (1 - 1e-12) and kept > 0 for room, kept in seen), seen


def _auto(job, mesh, monkeypatch, cut: bool):
    if not cut:
        monkeypatch.setattr(pipeline_search, "whole_step_cutoff", lambda *a, **k: None)
    else:
        monkeypatch.undo()
    model, inputs, loss, target = job
    return autopar.plan(model, mesh, example_inputs=inputs, loss_fn=loss, example_target=target, mode="auto")


def test_the_cutoff_keeps_autos_plan_where_launches_dominate(monkeypatch):
    """A small GPT on 4 H100s: its best plan, pp 2 at one microbatch, solved at 4 (the reference) takes
    three times one microbatch's launches more; the room for them keeps the candidate (without it the
    cutoff dropped it and AUTO returned dp 4)."""
    job = factories.gpt(hidden=64, layers=4, heads=4, seq=64, batch=16, vocab=2048)
    mesh = autopar.Mesh(4, device="h100", gpus_per_node=2)
    plain, cut = _auto(job, mesh, monkeypatch, False), _auto(job, mesh, monkeypatch, True)
    assert plain.degrees["pp"] == 2
    assert (cut.degrees, cut.microbatches, cut.schedule) == (plain.degrees, plain.microbatches, plain.schedule)
    assert cut.step_time == pytest.approx(plain.step_time, rel=1e-9)
