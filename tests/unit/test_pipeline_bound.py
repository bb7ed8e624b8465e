"""The pipeline candidates' step floor (``solver/pipeline_bound.py``): a lower bound on the step of the
plan each candidate's solves return, by which AUTO skips candidates that cannot beat its best plan;
the search returns the same plan with and without the pruning, and lists what it pruned."""
from __future__ import annotations

import math

import pytest

import autopar
from autopar.core.context import ParallelMode
from autopar.frontend.trace import trace
from autopar.graph.retrace import Retracer
from autopar.schedules.schedule import build_schedule, simulate
from autopar.graph.cut_points import assign_units
from autopar.solver.pipeline_bound import BOUND_ENV, floor_dominated, schedule_factor, stages_per_rank, step_floor
from autopar.solver.pipeline_fit import PipelineDominatedError, PipelineRequestError
from autopar.solver.pipeline_search import pipeline_candidates, plan_pipeline
from autopar.solver.request import PlanOptions
from examples import factories

PRUNED = "a lower bound on its step is"
_SMALL = lambda: factories.gpt(hidden=64, layers=4, heads=4, seq=64, batch=16, vocab=2048)  # noqa: E731


def _floors_and_steps(job, mesh, opts: PlanOptions):
    model, inputs, loss, target = job
    traced = trace(model, inputs, loss, target)
    retracer = Retracer(model, inputs, loss, target)
    cands, _ = pipeline_candidates(traced, mesh, ParallelMode.AUTO, {})
    out = []
    for cand in cands:
        floor = step_floor(traced, cand, ParallelMode.AUTO, opts, {}, {})
        try:
            plan = plan_pipeline(traced, cand, ParallelMode.AUTO, opts, {}, {}, retracer)
        except PipelineRequestError:
            continue
        # the floor covers the stages per rank the search tries (a search trying more must list them)
        units = len(assign_units(traced.gm)[0])
        assert plan.pipeline.virtual_stages in stages_per_rank(plan.schedule, cand.pp, plan.microbatches, units,
                                                               opts), (plan.schedule, plan.pipeline)
        out.append((cand.pp, cand.sub.shape, floor, plan.step_time))
    return out


def _check(rows, least: int):
    assert len(rows) >= least, rows
    for pp, sub, floor, step in rows:
        assert 0 < floor <= step * (1 + 1e-9), (pp, sub, floor, step)
    # the floor is not vacuous: it is a fair share of the solved step somewhere
    assert max(floor / step for *_, floor, step in rows) > 0.3, rows


def test_the_floor_is_below_every_solved_candidate():
    """Every pipeline candidate of a small GPT on 4 H100s (2 per node): floor <= the step its solves
    return (the plan at the candidate's own best microbatch count and schedule)."""
    rows = _floors_and_steps(_SMALL(), autopar.Mesh(4, device="h100", gpus_per_node=2), PlanOptions())
    _check(rows, 3)


@pytest.mark.slow
def test_the_floor_is_below_every_solved_candidate_on_8_devices():
    rows = _floors_and_steps(factories.gpt(hidden=64, layers=4, heads=4, seq=64, batch=16, vocab=2048),
                             autopar.Mesh(8, device="h100", gpus_per_node=4), PlanOptions())
    _check(rows, 4)


@pytest.mark.slow
@pytest.mark.parametrize("opts", [PlanOptions(zero=1), PlanOptions(recompute="full"),
                                  PlanOptions(precision="mixed", mixed_precision="bf16"),
                                  PlanOptions(memory_budget_gb=0.05)], ids=["zero1", "recompute", "bf16", "budget"])
def test_the_floor_is_below_every_solved_candidate_under_memory_options(opts):
    rows = _floors_and_steps(factories.gpt(hidden=128, layers=8, heads=4, seq=128, batch=16, vocab=4096),
                             autopar.Mesh(8, device="h100", gpus_per_node=4), opts)
    _check(rows, 3)


@pytest.mark.slow
def test_the_floor_is_below_every_solved_candidate_on_cpu_ranks():
    """CPU ranks share the cores (``DeviceSpec.shared_by``): the floor's solve prices them alike."""
    rows = _floors_and_steps(factories.gpt(hidden=64, layers=4, heads=4, seq=64, batch=8, vocab=1024),
                             autopar.Mesh(4, device="cpu"), PlanOptions())
    _check(rows, 2)


def _auto(job, mesh, monkeypatch, bound: bool):
    monkeypatch.setenv(BOUND_ENV, "1" if bound else "0")
    model, inputs, loss, target = job
    return autopar.plan(model, mesh, example_inputs=inputs, loss_fn=loss, example_target=target, mode="auto")


def _same(a, b):
    assert a.degrees == b.degrees
    assert (a.microbatches, a.schedule) == (b.microbatches, b.schedule)
    assert a.memory_options == b.memory_options
    assert a.step_time == pytest.approx(b.step_time, rel=1e-9)


@pytest.mark.slow
def test_pruning_keeps_the_plan_and_lists_what_it_pruned(monkeypatch):
    """AUTO with the floors (``AUTOPAR_PIPELINE_BOUND=1``) returns the plan it returns without them,
    and names a pruned candidate."""
    job, mesh = _SMALL(), autopar.Mesh(4, device="h100", gpus_per_node=2)
    pruned = _auto(job, mesh, monkeypatch, True)
    plain = _auto(job, mesh, monkeypatch, False)
    _same(pruned, plain)
    notes = [a.note for a in pruned.alternatives if PRUNED in a.note]
    assert notes and all(n.startswith("pp=") and "cannot beat the best plan so far" in n for n in notes)
    assert not any(PRUNED in a.note for a in plain.alternatives)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gpt-8", "llama-16", "gpt-cap"])
def test_pruning_keeps_the_plan_on_more_jobs(case, monkeypatch):
    if case == "gpt-8":
        job = factories.gpt(hidden=128, layers=8, heads=4, seq=128, batch=16, vocab=4096)
        mesh = autopar.Mesh(8, device="h100", gpus_per_node=4)
    elif case == "llama-16":
        job, mesh = factories.llama_1b(batch=16, seq=256), autopar.Mesh(16, device="h100", gpus_per_node=8)
    else:
        job = factories.gpt(hidden=256, layers=8, heads=8, seq=256, batch=32, vocab=8192)
        mesh = autopar.Mesh(8, device="v100-16gb", gpus_per_node=4, memory_gb=0.25)
    _same(_auto(job, mesh, monkeypatch, True), _auto(job, mesh, monkeypatch, False))


def test_a_floor_under_the_cutoff_prunes_nothing():
    assert floor_dominated(0.5, None) is None
    assert floor_dominated(0.5, 0.6) is None
    assert floor_dominated(None, 0.6) is None
    assert floor_dominated(0.5, math.inf) is None
    err = floor_dominated(0.6, 0.5)
    assert isinstance(err, PipelineDominatedError) and "cannot beat the best plan so far (0.5 s)" in str(err)


def test_one_stage_per_rank_has_the_closed_form():
    """v = 1: the least critical path over stage splits is W / (1 - (1 - 1/m)^p) (every rank's start
    chain plus its m microbatches equal); between m·W / p and (m + p - 1)·W / p."""
    for p, m in [(2, 1), (2, 4), (4, 3), (8, 16)]:
        x = schedule_factor(p, 1, m)
        assert x == pytest.approx(1 / (1 - (1 - 1 / m) ** p), rel=1e-5)
        assert m / p <= x <= (m + p - 1) / p + 1e-9


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_the_schedule_factor_is_below_every_simulated_schedule(kind):
    """For random stage times (skewed, any forward share), the simulated step of the schedule is never
    under schedule_factor x the work: the chains of the bound hold in ``simulate``'s model."""
    rng = __import__("random").Random(7)
    v = 2 if kind == "interleaved_1f1b" else 1
    for _ in range(60):
        p = rng.choice([2, 3, 4, 8])
        m = p * rng.choice([1, 2, 4]) if v > 1 else rng.choice([1, 2, 3, 4, 8, 16])
        t = [rng.random() ** 3 + 1e-6 for _ in range(p * v)]
        f = [x * rng.random() for x in t]
        sim = simulate(build_schedule(kind, p, m, v), f, [x - y for x, y in zip(t, f)]).step_time
        assert schedule_factor(p, v, m) * sum(t) <= sim * (1 + 1e-9), (p, m)
