"""Recomputation as a plan choice, planned in one process (``plan.memory_options.recompute``): AUTO/SEMI_AUTO
try "none", then "selective", then "full" at each accumulation k while nothing fits the memory cap; a user can fix
it (``set_auto_parallel_context(recompute=...)``). The cases that train on ranks are in
tests/ranks/test_recompute_search.py."""
from __future__ import annotations

import functools

import pytest
import torch

import autopar
from examples.models import GPT, lm_loss
from oracle import make_batch
from recompute_search_jobs import BATCH, MODEL, PIPE_MODEL, _capped_mesh, _pipe_capped_mesh, _pipe_plan


def test_auto_picks_recomputation_when_the_activations_do_not_fit():
    x, y = make_batch("tokens", BATCH)
    mesh = _capped_mesh(0.65)
    plan = autopar.plan(MODEL(), mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, mode="auto")
    assert plan.memory_options.recompute in ("selective", "full"), plan.memory_options
    assert max(plan.memory_per_device) <= mesh.memory_gb * 2**30
    assert f"recompute {plan.memory_options.recompute}" in plan.report()
    free = autopar.plan(MODEL(), autopar.Mesh(2, axis_names=("dp",)), example_inputs=(x,), loss_fn=lm_loss,
                        example_target=y, mode="auto")
    assert free.memory_options.recompute == "none", "without a cap nothing needs recomputation"
    assert plan.step_time > free.step_time, "the recomputed forward costs time"
    assert plan.memory_breakdown["activations"] < free.memory_breakdown["activations"]
    assert autopar.Plan.from_json(plan.to_json()) == plan


def test_user_fixed_recompute_is_planned_in_every_mode():
    x, y = make_batch("tokens", BATCH)
    plain = autopar.plan(MODEL(), autopar.Mesh(2), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                         mode="data")
    autopar.set_auto_parallel_context(recompute="full")
    plan = autopar.plan(MODEL(), autopar.Mesh(2), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                        mode="data")
    assert plan.memory_options.recompute == "full"
    assert plan.memory_breakdown["activations"] < plain.memory_breakdown["activations"]
    assert plan.step_time > plain.step_time


@pytest.mark.parametrize("value", ["some", {"blocks.0": "all"}, 1])
def test_bad_recompute_setting_is_refused(value):
    with pytest.raises(ValueError, match=r"recompute must be None, 'none', 'selective', 'except_attention', 'full' or a \{layer"):
        autopar.set_auto_parallel_context(recompute=value)


@functools.lru_cache(maxsize=None)
def _auto_under_tight_cap():
    """AUTO's plan under ``_capped_mesh(0.3)`` and the search stages it went through (one search, read by
    the two tests below; the progress callback only records)."""
    x, y = make_batch("tokens", BATCH)
    stages = []
    plan = autopar.plan(MODEL(), _capped_mesh(0.3), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                        mode="auto",
                        progress=lambda p: stages.append(p.stage) if not stages or stages[-1] != p.stage else None)
    return plan, stages


def test_the_fastest_of_accumulation_and_recomputation_wins():
    """Under a cap that neither lever alone meets at k = 1 without recomputation, the search keeps,
    for each recompute choice, the smallest accumulation that fits, and picks the fastest."""
    x, y = make_batch("tokens", BATCH)
    mesh = _capped_mesh(0.3)
    plan, _ = _auto_under_tight_cap()
    fits = [a for a in plan.alternatives if a.fits]
    assert all(plan.step_time <= a.step_time for a in fits)
    options = {plan.memory_options.summary()} | {a.memory_options for a in fits}
    assert any("accumulation" in o for o in options) and any("recompute" in o for o in options), options
    report = plan.report()
    assert "memory options" in report and plan.memory_options.summary() in report
    for rc in ("none", "full"):
        autopar.set_auto_parallel_context(recompute=rc)
        forced = autopar.plan(MODEL(), mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, mode="auto")
        assert forced.step_time >= plan.step_time


def test_pipeline_stage_memory_drops_what_recomputation_does_not_save():
    """A pipeline stage holds each in-flight microbatch's saved tensors: under recompute "full"
    only the layers' inputs (it was charged every saved tensor while paying the recompute time)."""
    model = GPT(vocab=128, hidden=64, heads=4, layers=4, seq=32)
    x = torch.randint(0, 128, (8, 32))
    acts = {}
    for rc in ("none", "full"):
        autopar.set_auto_parallel_context(recompute=rc)
        try:
            p = autopar.plan(model, autopar.Mesh((2, 1), axis_names=("pp", "tp")), example_inputs=(x,),
                             loss_fn=lm_loss, example_target=x, mode="semi_auto")
        finally:
            autopar.reset_auto_parallel_context()
        assert p.degrees["pp"] == 2 and p.memory_options.recompute == rc
        acts[rc] = p.memory_breakdown["activations"]
    assert acts["full"] < 0.25 * acts["none"]


def test_auto_pipelines_with_recomputation_when_nothing_else_fits():
    """AUTO tries pipelines under every recompute choice (each candidate until it fits): a cap that
    a 2-stage pipeline meets only by recomputing gives a recomputed pipeline, not an error."""
    mesh = _pipe_capped_mesh()
    plan = _pipe_plan(mesh)
    assert plan.degrees["pp"] == 2 and plan.memory_options.recompute != "none", plan.memory_options
    assert max(plan.memory_per_device) <= mesh.memory_gb * 2**30


def _stages_and_plan(mesh):
    # ZeRO fixed at 0: the order tested is of recompute choices, pipelines and accumulations within a
    # ZeRO stage (the ZeRO-0 stage names below), and four stages' ladders took 2.5x as long
    autopar.set_auto_parallel_context(zero=0)
    stages = []
    x = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))

    def seen(progress):
        if not stages or stages[-1] != progress.stage:
            stages.append(progress.stage)

    plan = autopar.plan(PIPE_MODEL(), mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=x, mode="auto",
                        progress=seen)
    return stages, plan


def test_state_needs_pipeline_compares_the_state_over_a_node_with_the_cap():
    from autopar.cost_models.memory import param_numel
    from autopar.solver.mesh_solve import PlanOptions
    from autopar.solver.search import state_needs_pipeline
    from autopar.frontend.trace import trace

    x = torch.zeros(8, 32, dtype=torch.long)
    traced = trace(PIPE_MODEL(), (x,), lm_loss, x)
    state = 16 * param_numel(traced.gm)           # fp32 AdamW: weights, gradients, two moments
    opts = PlanOptions()
    for per_node, cap in [(2, state / 2 * 0.99), (2, state / 2 * 1.01), (4, state / 4 * 0.99)]:
        mesh = autopar.Mesh(8, gpus_per_node=per_node, memory_gb=cap / 2**30)
        assert state_needs_pipeline(traced, mesh, opts, cap) == (cap < state / per_node), (per_node, cap)


def test_recomputed_pipelines_come_before_the_accumulation_ladder_when_the_state_needs_them(monkeypatch):
    """When nothing fits at k = 1 and the state over a node exceeds the cap, the recomputed
    pipelines are tried before accumulation 2; they can only add candidates, so the plan found
    is predicted no slower than the one the ladder-first order finds (here it is the pipeline)."""
    from autopar.solver import search

    mesh = autopar.Mesh(2, memory_gb=_pipe_capped_mesh().memory_gb)
    monkeypatch.setattr(search, "state_needs_pipeline", lambda *a: False)
    ladder_stages, ladder_first = _stages_and_plan(mesh)
    monkeypatch.setattr(search, "state_needs_pipeline", lambda *a: True)
    stages, plan = _stages_and_plan(mesh)
    first = stages.index("ZeRO-0, recompute full, accumulation 1: pipelines first")
    assert first < stages.index("ZeRO-0, recompute none, accumulation 2"), stages
    assert not any("pipelines first" in s for s in ladder_stages)
    assert plan.step_time <= ladder_first.step_time
    assert plan.degrees["pp"] == 2 and plan.memory_options.recompute != "none", plan.memory_options
    assert max(plan.memory_per_device) <= mesh.memory_gb * 2**30


def test_every_zero_stage_is_searched_before_more_recomputation():
    """The search runs each recompute choice over every ZeRO stage before the next choice: ZeRO-1..3
    cost collectives only, recomputation a forward, so their plans bound the recomputed ladders (GPT
    6.7B on 16 V100s: 87 -> 47 s of planning, same plan). The plan is still the fastest of all."""
    x, y = make_batch("tokens", BATCH)
    mesh = _capped_mesh(0.3)
    plan, stages = _auto_under_tight_cap()
    zero_none = [i for i, s in enumerate(stages) if s.startswith("ZeRO-1, recompute none")]
    recomputed = [i for i, s in enumerate(stages) if s.startswith("ZeRO") and "recompute none" not in s]
    assert zero_none and recomputed and max(zero_none) < min(recomputed), stages
    for z in (0, 1):
        autopar.set_auto_parallel_context(zero=z)
        forced = autopar.plan(MODEL(), mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, mode="auto")
        assert forced.step_time >= plan.step_time, (z, forced.memory_options, plan.memory_options)


KEPT_MODEL = functools.partial(GPT, qkv_bias=False, layers=4, hidden=32)


def _kept_plan(mesh, **kw):
    x, y = make_batch("tokens", BATCH)
    autopar.set_auto_parallel_context(accumulation=1, zero=0, **kw)
    try:
        return autopar.plan(KEPT_MODEL(), mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, mode="auto")
    finally:
        autopar.reset_auto_parallel_context()


def test_auto_keeps_the_attention_core_when_that_fits():
    """Under a cap that "except_attention" fits and "selective" does not, the search's probe after "full"
    (``solver/attention_kept.py``) recomputes every layer around its attention core: faster than "full"."""
    dp = autopar.Mesh(2, axis_names=("dp",))
    fixed = {rc: _kept_plan(dp, recompute=rc) for rc in ("selective", "except_attention", "full")}
    peak = {rc: max(p.memory_per_device) for rc, p in fixed.items()}
    assert peak["full"] < peak["except_attention"] < peak["selective"]
    assert fixed["full"].step_time > fixed["except_attention"].step_time
    cap = peak["except_attention"] * 1.02
    plan = _kept_plan(autopar.Mesh(2, axis_names=("dp",), memory_gb=cap / 2**30))
    assert plan.memory_options.recompute == {f"blocks.{i}": "except_attention" for i in range(4)}
    assert max(plan.memory_per_device) <= cap
    assert plan.step_time == pytest.approx(fixed["except_attention"].step_time)
    assert any(a.memory_options == "recompute full" for a in plan.alternatives)
    assert "recompute except_attention on 4 layers" in plan.report()


@pytest.mark.parametrize("value", ["some", {"blocks.0": "all"}])
def test_a_plan_with_an_unknown_recompute_choice_is_refused(value):
    from autopar.plan.plan import MemoryOptions, PlanError
    with pytest.raises(PlanError, match=r"recompute='(some|all)' is not known; use one of none, selective, "
                                        r"except_attention, full \(or a \{layer name: choice\} mapping\)"):
        MemoryOptions(recompute=value)
