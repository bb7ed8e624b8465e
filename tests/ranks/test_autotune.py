"""AUTO's measured choice (autotune_top_k): the ranks time the best predicted plans and keep the fastest."""
import dataclasses
import functools
import re

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.modules.autotune import TIE, Trial, choose, layout_key, pick, plan_label, shortlist
from conftest import run_ranks
from examples.models import MLP
from oracle import assert_same_training, make_batch, parallel_run, reference_run

# wide enough that three of AUTO's candidates split work on every mesh axis (AUTO leaves out plans
# that repeat the work on an axis: on a narrower MLP only the DDP layout is left to time)
D_IN = 256
MODEL = functools.partial(MLP, d_in=D_IN, hidden=512, d_out=10, depth=2)


def _autotune_job(rank):
    x, y = make_batch("vector", 8, d_in=D_IN)
    torch.manual_seed(0)
    before = {k: v.clone() for k, v in MODEL().state_dict().items()}
    autopar.set_auto_parallel_context(autotune_top_k=3, autotune_steps=2, autotune_slack=100.0)
    try:
        out = parallel_run(rank, MODEL, F.cross_entropy, x, y, autopar.Mesh(4), "auto")
    finally:
        autopar.reset_auto_parallel_context()
    torch.manual_seed(0)
    out["untouched"] = all(torch.equal(before[k], v) for k, v in MODEL().state_dict().items())
    return out


def test_autotune_times_the_best_predicted_plans_and_trains_like_one_device():
    x, y = make_batch("vector", 8, d_in=D_IN)
    ref = reference_run(MODEL, F.cross_entropy, x, y)
    results = run_ranks(4, _autotune_job)
    plans = [autopar.Plan.from_json(r["plan"]) for r in results]
    assert len({p.to_json() for p in plans}) == 1, "every rank must choose the same plan"
    trials = plans[0].autotune
    assert len(trials) == 3 and sum(t.chosen for t in trials) == 1
    chosen = next(t for t in trials if t.chosen)
    fastest = min(t.measured for t in trials if t.measured is not None)
    assert chosen.measured <= (1 + TIE) * fastest
    assert all(t.measured > (1 + TIE) * fastest for t in trials[:trials.index(chosen)]), \
        "a better predicted plan within the tie margin must win"
    assert all(t.measured > 0 and t.predicted > 0 for t in trials)
    raced = [t for t in trials if t.steps == 2 + 2 * 2]     # the 2 fastest and close calls: 2 steps, 4 more
    assert all(t.steps in (2, 6) for t in trials) and len(raced) >= 2
    assert len({t.label for t in trials}) == 3
    assert "measured on the ranks" in plans[0].report()
    assert plans[0].autotune_timing == "interleaved"
    for r in results:
        assert_same_training(ref, r, what="autotuned AUTO")


def test_autotune_settings_are_checked():
    with pytest.raises(ValueError, match="autotune_top_k must be an int >= 0"):
        autopar.set_auto_parallel_context(autotune_top_k=-1)
    with pytest.raises(ValueError, match="autotune_steps must be an int >= 1"):
        autopar.set_auto_parallel_context(autotune_steps=0)
    with pytest.raises(ValueError, match="autotune_slack must be a number >= 1"):
        autopar.set_auto_parallel_context(autotune_slack=0.5)


def _one_at_a_time_job(rank):
    """A memory budget that fits each trial copy but not three together: timed one by one. The third
    layout timed is a pipeline, which the search would drop as over 1.1x the best plan's step by its
    reference estimate (``pipeline_search.REFERENCE_MARGIN``); this job keeps it."""
    from autopar.solver import pipeline_search
    margin, pipeline_search.REFERENCE_MARGIN = pipeline_search.REFERENCE_MARGIN, float("inf")
    try:
        return _timed_one_at_a_time(rank)
    finally:
        pipeline_search.REFERENCE_MARGIN = margin    # the rank processes serve later tests too


def _timed_one_at_a_time(rank):
    x, y = make_batch("vector", 8, d_in=D_IN)
    torch.manual_seed(0)
    planned = autopar.plan(MODEL(), autopar.Mesh(4), example_inputs=(x,), loss_fn=F.cross_entropy,
                           example_target=y, mode="auto")
    peaks = [max(planned.memory_per_device)] + [a.memory for a in planned.alternatives
                                                if a.fits and not a.redundant_axes][:2]   # the three timed
    budget_gb = (max(peaks) + sum(peaks)) / 2 / 2**30
    autopar.set_auto_parallel_context(autotune_top_k=3, autotune_steps=1, autotune_slack=100.0,
                                      memory_budget_gb=budget_gb)
    try:
        return parallel_run(rank, MODEL, F.cross_entropy, x, y, autopar.Mesh(4), "auto")
    finally:
        autopar.reset_auto_parallel_context()


def test_autotune_times_one_plan_at_a_time_when_the_copies_exceed_memory():
    x, y = make_batch("vector", 8, d_in=D_IN)
    ref = reference_run(MODEL, F.cross_entropy, x, y)
    results = run_ranks(4, _one_at_a_time_job)
    plan = autopar.Plan.from_json(results[0]["plan"])
    assert plan.autotune_timing.startswith("one plan at a time")
    assert len(plan.autotune) == 3
    assert all(t.measured is not None and t.steps in (1, 3) for t in plan.autotune)
    assert sum(t.steps == 3 for t in plan.autotune) >= 2
    assert "one plan at a time" in plan.report()
    for r in results:
        assert_same_training(ref, r, what="autotuned AUTO, one plan at a time")


def _plans(top_k):
    from autopar.api import _plan_traced
    from autopar.graph.retrace import Retracer
    from autopar.frontend.trace import trace

    x, y = make_batch("vector", 8, d_in=D_IN)
    torch.manual_seed(0)
    model = MODEL()
    return _plan_traced(model, trace(model, (x,), F.cross_entropy, y), Retracer(model, (x,), F.cross_entropy, y),
                        autopar.Mesh(4), autopar.ParallelMode.AUTO, top_k)


def test_shortlist_keeps_plans_within_the_slack_and_one_per_layout():
    plans = _plans(8)
    assert len(plans) >= 3
    best = plans[0].step_time
    renamed = dataclasses.replace(plans[0], mesh=plans[0].mesh.reshape(plans[0].mesh.shape,
                                                                        tuple(f"x{i}" for i in range(plans[0].mesh.ndim))))
    assert layout_key(renamed) == layout_key(plans[0]) and plan_label(renamed) != plan_label(plans[0])
    out = shortlist([plans[0], renamed] + plans[1:], 1.5)
    assert renamed not in out and out[0] is plans[0]
    assert [p for p in out] == [p for p in plans if p.step_time <= 1.5 * best
                                and layout_key(p) not in {layout_key(q) for q in plans[:plans.index(p)]}]
    assert all(p.step_time <= 1.0 * best for p in shortlist(plans, 1.0))
    assert len(shortlist(plans, 1e9)) == len({layout_key(p) for p in plans})


def test_autotune_is_on_by_default_and_the_environment_turns_it_off(monkeypatch):
    monkeypatch.delenv("AUTOPAR_AUTOTUNE_TOP_K", raising=False)
    autopar.reset_auto_parallel_context()
    ctx = autopar.get_auto_parallel_context()
    assert (ctx["autotune_top_k"], ctx["autotune_steps"], ctx["autotune_slack"]) == (6, 8, 1.5)
    monkeypatch.setenv("AUTOPAR_AUTOTUNE_TOP_K", "0")
    autopar.reset_auto_parallel_context()
    assert autopar.get_auto_parallel_context()["autotune_top_k"] == 0
    monkeypatch.setenv("AUTOPAR_AUTOTUNE_TOP_K", "four")
    with pytest.raises(ValueError, match="AUTOPAR_AUTOTUNE_TOP_K must be an integer .* got 'four'"):
        autopar.reset_auto_parallel_context()
    monkeypatch.setenv("AUTOPAR_AUTOTUNE_TOP_K", "0")
    autopar.reset_auto_parallel_context()


def test_pick_prefers_the_better_predicted_plan_when_measurements_tie():
    def trials(*measured):
        return [Trial(f"p{i}", 0.01 * (i + 1), m) for i, m in enumerate(measured)]

    assert pick(trials(0.100, 0.090)) == 1                  # 10 % apart: the clock decides
    assert pick(trials(0.0925, 0.090)) == 0                 # within 3 %: the better predicted
    assert pick(trials(0.120, 0.0925, 0.090)) == 1
    assert pick(trials(float("inf"), 0.090)) == 1
    assert pick(trials(float("inf"), float("inf"))) == 0


class _StubModule(torch.nn.Module):
    """Stands in for a built plan: a step that does nothing, one parameter."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def step(self, *inputs, target=None):
        return torch.zeros(())


def test_a_plan_that_cannot_be_built_is_listed_with_its_reason_and_warned_about():
    """Every pipelined plan of a Hugging Face Llama failed to build (KeyError: 'submod_3') and
    autotune dropped them without a word: the reason now names the exception, where it was raised
    and the rank, in the trials, the report and a warning."""
    plans = shortlist(_plans(8), 1e9)[:3]
    assert len(plans) == 3
    broken = plans[1]

    def build(model, plan):
        if plan is broken:
            raise KeyError("submod_3")
        return _StubModule()

    x, y = make_batch("vector", 8, d_in=32)
    with pytest.warns(RuntimeWarning, match=rf"autotune: plan {re.escape(plan_label(broken))} could not be built "
                                            r"and was not timed: KeyError: 'submod_3' \(test_autotune.py:\d+ in build\) on rank 0"):
        chosen = choose(plans, MODEL(), build, (x,), y, steps=1, slack=1e9)
    trials = chosen.autotune
    failed = [t for t in trials if t.error]
    assert [t.label for t in failed] == [plan_label(broken)] and failed[0].measured is None
    assert failed[0].error.startswith("KeyError: 'submod_3' (test_autotune.py:")
    assert chosen is not broken
    assert f"not built: {failed[0].error}" in chosen.report()


def _fails_on_rank_1_job(rank):
    plans = shortlist(_plans(8), 1e9)[:2]

    def build(model, plan):
        if plan is plans[1] and rank == 1:
            raise ValueError("no such stage")
        return _StubModule()

    x, y = make_batch("vector", 8, d_in=32)
    chosen = choose(plans, MODEL(), build, (x,), y, steps=1, slack=1e9)
    return [t.error for t in chosen.autotune]


def test_a_plan_that_fails_on_one_rank_is_dropped_on_all_with_that_ranks_reason():
    errors = run_ranks(2, _fails_on_rank_1_job)
    assert errors[0] == errors[1]
    assert errors[0][0] == "" and re.fullmatch(r"ValueError: no such stage \(test_autotune.py:\d+ in build\) on rank 1",
                                               errors[0][1])
