"""The search reports its progress and stops at a time budget with the best plan so far (planned in one process;
the case that runs the command line is in tests/ranks/test_search_progress.py)."""
from __future__ import annotations

import io
import sys

import pytest

import autopar
from autopar.report.progress_display import ProgressDisplay
from autopar.solver.progress import SearchProgress
from autopar.solver.search import rank_key
from examples import factories
from search_progress_jobs import _job, _plan


def test_progress_reports_stages_counts_and_the_best_so_far():
    seen = []
    plan = _plan(progress=lambda p: seen.append((p.stage, p.evaluated, p.fitting, p.best_time)))
    stages = [s for s, *_ in seen]
    assert stages[0] == "tracing the training step" and any(s.startswith("ZeRO-0, recompute none") for s in stages)
    counts = [n for _, n, _, _ in seen]
    assert counts == sorted(counts) and counts[-1] > 1
    fitting = seen[-1][2]
    assert fitting == 1 + sum(a.fits for a in plan.alternatives)
    assert seen[-1][3] == pytest.approx(min([plan.step_time] + [a.step_time for a in plan.alternatives if a.fits]))
    assert plan.search_note == "" and "note:" not in plan.report()


def test_time_budget_returns_the_best_so_far_and_says_so():
    full = _plan()
    cut = _plan(time_budget=1e-3)
    assert "stopped by the time budget of 0.001 s" in cut.search_note
    assert "best plan found so far" in cut.report()
    assert len(cut.alternatives) < len(full.alternatives)
    assert rank_key(cut) >= rank_key(full)            # what AUTO minimises: never better than the whole search


def test_the_display_writes_one_live_line_without_tqdm(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)          # import fails: the plain line is used
    stream = io.StringIO()
    display = ProgressDisplay(stream, min_interval_s=0.0)
    progress = SearchProgress(10.0, display)
    progress.enter("ZeRO-1, recompute none, accumulation 2")
    display.close()
    text = stream.getvalue()
    assert text.startswith("\rplanning [") and "of 10 s] ZeRO-1, recompute none, accumulation 2" in text
    assert "0 candidates | no plan fits yet" in text and text.endswith("\n")


def test_a_time_budget_also_limits_each_solve():
    """Once a plan fits, a solve may use only what is left of the budget (at least 0.5 s); before one
    fits, or without a budget, the solver's own limit stands."""
    from autopar.solver.mesh_solve import PlanOptions
    from autopar.solver.search import _within_budget

    opts = PlanOptions(time_limit_s=10.0)
    assert _within_budget(opts, SearchProgress()).time_limit_s == 10.0
    progress = SearchProgress(time_budget_s=3.0)
    assert _within_budget(opts, progress).time_limit_s == 10.0  # nothing fits yet: the search goes on
    progress.fitting = 1
    assert 0.5 <= _within_budget(opts, progress).time_limit_s <= 3.0
    progress.started -= 100.0
    assert _within_budget(opts, progress).time_limit_s == 0.5


def test_a_time_budget_stops_the_pipeline_search_between_candidates():
    """Pipeline candidates count as they are solved, so a budget that has run out stops the search
    after the first one that fits (the search once solved every pipeline candidate first). A stage
    tag asks for pipelines only (pp = 2, three sub-meshes of 4 devices)."""
    def pipelined(plan):
        return [a for a in plan.alternatives if a.fits and a.degrees.get("pp", 1) > 1] + \
            ([plan] if plan.degrees["pp"] > 1 else [])

    def tagged(**kw):
        model, x, loss, target = _job()
        autopar.pipeline_stage(model.blocks[1], 1)
        try:
            return autopar.plan(model, autopar.Mesh(8, device="h100"), example_inputs=x, loss_fn=loss,
                                example_target=target, mode="auto", **kw)
        finally:
            autopar.clear_annotations()
    assert len(pipelined(tagged())) > 1
    assert len(pipelined(tagged(time_budget=1e-3))) == 1


def test_pipelines_are_searched_after_the_meshes_and_bounded_by_their_best():
    """Without a pipeline request the meshes come first; a pipeline candidate whose estimate by the
    reference microbatch's costs is over 1.1x the best plan so far is dropped with that reason."""
    # batch 32: at batch 8 every pipeline candidate came within 1.1x once causal attention cost its half
    model, x, loss, target = factories.gpt(hidden=512, layers=4, heads=8, seq=256, batch=32, vocab=1024)
    plan = autopar.plan(model, autopar.Mesh(8, device="h100"), example_inputs=x, loss_fn=loss, example_target=target,
                        mode="auto")
    dropped = [a.note for a in plan.alternatives if "slower than the best plan so far" in a.note]
    assert dropped and all("not solved at other microbatch sizes" in n for n in dropped)
    fits = [a.step_time for a in plan.alternatives if a.fits] + [plan.step_time]
    assert plan.step_time == min(fits)


def test_a_candidate_that_would_end_after_the_budget_is_not_started():
    """``out_of_time``: once a plan fits, the search stops when less of the budget is left than a
    candidate takes (the median of the last intervals between records), and stays stopped; the
    note says when and why."""
    import time

    progress = SearchProgress(time_budget_s=10.0)
    progress.marks = [0.0, 3.0, 6.0, 9.0]
    progress.started = time.perf_counter() - 6.5
    assert not progress.out_of_time()           # nothing fits yet
    progress.fitting = 1
    assert progress.typical() == 3.0 and not progress.out_of_time()     # 3.5 s left
    progress.started -= 1.0
    assert progress.out_of_time()                                        # 2.5 s left < 3 s
    progress.marks += [9.1, 9.2, 9.3, 9.4]
    assert progress.typical() < 1.0 and progress.out_of_time()           # stopped stays stopped
    assert "search stopped by the time budget of 10 s after 0 candidates" in progress.stopped_note()
    assert "at 7.5 s, the next candidate not started (~3.0 s each)" in progress.stopped_note()


@pytest.mark.parametrize("first", [False, True])
def test_pipelines_come_before_the_meshes_when_the_state_needs_a_pipeline(monkeypatch, first):
    """``_candidates(pipelines_first=)``: the pipelines are solved before the meshes without stages
    (whose best then bounds nothing of theirs), else after them; both are solved either way."""
    import autopar.solver.search as search
    from autopar.core.context import ParallelMode
    from autopar.solver.mesh_solve import PlanOptions
    from autopar.solver.request import SolveRequest
    from autopar.frontend.trace import trace

    order = []
    real_mesh, real_pipes = search.solve_on_mesh, search.pipeline_plans

    def mesh_solve(*a, **k):
        order.append("mesh")
        return real_mesh(*a, **k)

    def pipes(*a, **k):
        order.append("pipelines")
        return real_pipes(*a, **k)

    monkeypatch.setattr(search, "solve_on_mesh", mesh_solve)
    monkeypatch.setattr(search, "pipeline_plans", pipes)
    model, x, loss, target = _job()
    traced = trace(model, x, loss, target)
    plans, _, _ = search._candidates(SolveRequest(traced, model, autopar.Mesh(4, device="h100"), ParallelMode.AUTO,
                                                  PlanOptions(), {}, {}, None), pipelines_first=first)
    assert order.count("pipelines") == 1 and "mesh" in order
    assert (order[0] == "pipelines") is first and (order[-1] == "pipelines") is not first
    assert plans
