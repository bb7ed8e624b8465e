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
