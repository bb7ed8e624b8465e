"""``pipeline_steer.between_shares``: when a tightened whole-model budget of a pipeline candidate is
infeasible, the layout is solved again between it and the last budget a layout fitted, not without a
budget (every weight whole, which fits no stage cut)."""
from __future__ import annotations

import pytest

import autopar
import autopar.solver.pipeline_search as ps
from autopar.solver.intra_op import InfeasibleError
from autopar.solver.pipeline_steer import LEAST_ROOM, between_shares
from examples.models import GPT, lm_loss
from oracle import make_batch

X, Y = make_batch("tokens", 8)


def test_between_shares_orders_the_least_memory_budget_before_the_midpoint():
    assert between_shares(0.5, 1.0, 40.0, 64.0) == pytest.approx([40.0 * LEAST_ROOM / 64.0, 0.75])
    assert between_shares(0.5, 1.0, None, 64.0) == pytest.approx([0.75])
    assert between_shares(0.5, 1.0, 10.0, 64.0) == pytest.approx([0.75])     # the least is under the failed budget
    assert between_shares(0.5, 1.0, 60.0, 64.0) == pytest.approx([0.75])     # over the fitted one
    assert between_shares(0.5, None, 40.0, 64.0) == []                       # no budget fitted: nothing between


def _plan_recording(monkeypatch, steer: bool):
    """GPT on pp 2 x tp 2 under a cap no stage cut of the pp x cap layout fits, with the tightened budget
    forced far under the least memory (infeasible); the whole-model solves' (budget GiB, outcome)."""
    calls = []
    orig = ps.solve_on_mesh

    def recording(req, *a, **k):
        try:
            plan = orig(req, *a, **k)
        except InfeasibleError as err:
            calls.append((req.opts.memory_budget_gb, err))
            raise
        calls.append((req.opts.memory_budget_gb, plan))
        return plan

    monkeypatch.setattr(ps, "solve_on_mesh", recording)
    monkeypatch.setattr(ps, "_next_share", lambda share, tighter, whole, total: 1e-3)
    if not steer:
        monkeypatch.setattr(ps, "between_shares", lambda *a: [])
    monkeypatch.setattr(ps, "reference_count", lambda counts, pp: 4)   # solved first at 4 microbatches of 2 rows
    autopar.set_auto_parallel_context(recompute="none")
    mesh = autopar.Mesh((2, 2), axis_names=("pp", "tp"), memory_gb=0.017)
    try:
        plan = autopar.plan(GPT(qkv_bias=False, layers=4, hidden=256), mesh, example_inputs=(X,), loss_fn=lm_loss,
                            example_target=Y, mode="semi_auto")
    finally:
        autopar.reset_auto_parallel_context()
    return plan, calls


def test_an_infeasible_tightened_budget_steers_between_not_to_no_budget(monkeypatch):
    with pytest.raises(autopar.PlanError):      # the old fallback: solved without a budget, no cut fits
        _plan_recording(monkeypatch, steer=False)
    monkeypatch.undo()
    plan, calls = _plan_recording(monkeypatch, steer=True)
    (first, fitted), (tight, err), (steered, sub) = calls[:3]
    assert not isinstance(fitted, Exception) and isinstance(err, InfeasibleError) and tight < first
    least = err.least_memory / 2**30
    assert steered == pytest.approx(least * LEAST_ROOM, rel=1e-6) and tight < steered < first
    assert not isinstance(sub, Exception) and max(sub.memory_per_device) / 2**30 <= steered
    assert all(budget < 1e5 for budget, _ in calls)         # never solved without a budget
    assert plan.pipeline is not None and max(plan.memory_per_device) <= 0.017 * 2**30


def _first_share_infeasible(monkeypatch, force_explain: bool):
    """GPT on pp 2 x tp 2 under a cap whose pp x cap whole-model budget no layout fits: (the PlanError's
    text, the whole-model solves' (explain, error or None))."""
    calls = []
    orig = ps.solve_on_mesh

    def recording(req, *a, **k):
        if force_explain:
            k["explain"] = True
        try:
            plan = orig(req, *a, **k)
        except InfeasibleError as err:
            calls.append((k.get("explain", True), err))
            raise
        calls.append((k.get("explain", True), None))
        return plan

    monkeypatch.setattr(ps, "solve_on_mesh", recording)
    autopar.set_auto_parallel_context(recompute="none")
    mesh = autopar.Mesh((2, 2), axis_names=("pp", "tp"), memory_gb=0.012)
    try:
        with pytest.raises(autopar.PlanError) as info:
            autopar.plan(GPT(qkv_bias=False, layers=4, hidden=256), mesh, example_inputs=(X,), loss_fn=lm_loss,
                         example_target=Y, mode="semi_auto")
    finally:
        autopar.reset_auto_parallel_context()
    return str(info.value), calls


def test_a_first_infeasible_share_is_not_explained_and_changes_nothing(monkeypatch):
    """No budget has fitted yet, so the error of the first whole-model solve is discarded (solved again
    without a budget): it carries no least-memory solve, only the memory floor; the outcome is the same."""
    text, calls = _first_share_infeasible(monkeypatch, force_explain=False)
    (explain, err), (_, loose) = calls[:2]
    assert explain is False and isinstance(err, InfeasibleError) and loose is None
    assert err.least_memory is None and "(the memory floor)" in str(err)
    monkeypatch.undo()
    explained_text, explained = _first_share_infeasible(monkeypatch, force_explain=True)
    assert explained[0][1].least_memory is not None and "smallest achievable" in str(explained[0][1])
    assert explained_text == text
