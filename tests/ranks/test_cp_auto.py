"""AUTO's context-parallel plan (issue 35 part 4) trains like one device: a GPT whose one row and
one attention head neither dp nor a heads split can divide, planned by AUTO on an unnamed
Mesh(4) (its cp candidates: ``solver/cp_candidates.py``), run on 4 ranks through the oracle."""
from __future__ import annotations

import functools

import autopar
import conftest
from cp_models import TinyGPT, token_loss, tokens
from oracle import assert_same_training, parallel_run, reference_run

MODEL = functools.partial(TinyGPT, heads=1)


def _job(rank, plan_json):
    x, y = tokens(1)
    plan = autopar.Plan.from_json(plan_json)
    return parallel_run(rank, MODEL, token_loss, x, y, plan.mesh, "hybrid", plan=plan)


def test_auto_cp_plan_trains_like_one_device():
    x, y = tokens(1)
    autopar.set_auto_parallel_context(recompute="none", zero=0)     # the mesh is the question here
    try:
        plan = autopar.plan(MODEL(), autopar.Mesh(4), example_inputs=(x,), loss_fn=token_loss, example_target=y)
    finally:
        autopar.reset_auto_parallel_context()
    assert plan.degrees["cp"] == 4, plan.report()
    assert "context parallelism: cp=4" in plan.report()
    ref = reference_run(MODEL, token_loss, x, y)
    for r in conftest._pool(4).run(conftest._fresh_call, _job, plan.to_json(), timeout_s=600):
        assert_same_training(ref, r, what="AUTO's cp plan")
        assert r["degrees"]["cp"] == 4


def _pipeline_cp_plan(rows: int):
    """AUTO's cp pipeline candidate on an unnamed Mesh(4) for a GPT of ``rows`` rows (pp 2 x cp 2: two
    rows give the two stages their two microbatches only with the sequence split), solved as AUTO's
    search solves it (``pipeline_search.plan_pipeline``)."""
    from autopar.core.context import ParallelMode
    from autopar.frontend.trace import trace
    from autopar.graph.retrace import Retracer
    from autopar.solver.pipeline_candidates import pipeline_candidates
    from autopar.solver.pipeline_search import plan_pipeline
    from autopar.solver.request import PlanOptions

    x, y = tokens(rows)
    model = functools.partial(TinyGPT, layers=4)()
    traced = trace(model, (x,), token_loss, y)
    cands, _ = pipeline_candidates(traced, autopar.Mesh(4), ParallelMode.AUTO, {})
    cand = next(c for c in cands if "cp" in c.sub.axis_names)
    return plan_pipeline(traced, cand, ParallelMode.AUTO, PlanOptions(recompute="none"), {}, {},
                         Retracer(model, (x,), token_loss, y))


def _pipeline_job(rank, plan_json):
    x, y = tokens(2)
    plan = autopar.Plan.from_json(plan_json)
    return parallel_run(rank, functools.partial(TinyGPT, layers=4), token_loss, x, y, plan.mesh, "hybrid", plan=plan)


def test_auto_cp_pipeline_candidate_trains_like_one_device():
    """AUTO's pipeline candidate with a cp axis (``cp_candidates.pipeline_cp_shapes``): pp 2 x cp 2 on
    two rows, two microbatches of one row each, trains like one device on 4 ranks."""
    plan = _pipeline_cp_plan(2)
    assert plan.degrees["pp"] == 2 and plan.degrees["cp"] == 2 and plan.microbatches == 2, plan.report()
    x, y = tokens(2)
    ref = reference_run(functools.partial(TinyGPT, layers=4), token_loss, x, y)
    for r in conftest._pool(4).run(conftest._fresh_call, _pipeline_job, plan.to_json(), timeout_s=600):
        assert_same_training(ref, r, what="AUTO's cp pipeline plan")
        assert r["degrees"]["pp"] == 2 and r["degrees"]["cp"] == 2
