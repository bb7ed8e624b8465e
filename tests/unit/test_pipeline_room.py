"""The room a pipeline candidate's stage cut is ranked in at each microbatch count (issue 32): the
reference solve's backward workspace is a lower bound for a count of smaller microbatches, not
charged whole; a refused candidate's note lists the counts that came closest to fitting first."""
from __future__ import annotations

import re

import pytest
import torch

import autopar
from autopar.core.context import ParallelMode
from autopar.graph.retrace import Retracer
from autopar.solver import pipeline_search as ps
from autopar.solver.mesh_solve import PlanOptions
from autopar.solver.pipeline_search import pipeline_candidates
from autopar.frontend.trace import trace
from examples.models import GPT, lm_loss

CAP_GB = 0.1


def _job():
    """A GPT whose loss's logits (vocabulary 32000) are the largest backward workspace by far."""
    with torch.device("meta"):
        model = GPT(vocab=32000, hidden=64, heads=4, layers=4, seq=64)
    x = torch.randint(0, 32000, (32, 64))
    return model, x


def _plan(model, x, **ctx):
    autopar.set_auto_parallel_context(recompute="none", **ctx)
    try:
        return autopar.plan(model, autopar.Mesh((2,), axis_names=("pp",), device="h100"), example_inputs=(x,),
                            loss_fn=lm_loss, example_target=x, mode="semi_auto")
    finally:
        autopar.reset_auto_parallel_context()


def test_many_small_microbatches_are_ranked_in_the_room_their_own_workspace_leaves():
    """The reference solve (4 microbatches of 8 rows) holds a logits-sized workspace that leaves no
    room for the stages at the 0.1 GiB cap; 16 microbatches of 2 rows hold a quarter of it and fit,
    by the plan's own figures. Charging the reference's workspace at every count refused them all."""
    model, x = _job()
    cap = CAP_GB * 2**30
    plan = _plan(model, x, memory_budget_gb=CAP_GB)
    ref = 4                 # ``plan_pipeline``'s reference count: the largest m <= 2 pp
    assert plan.microbatches > ref, plan.microbatches
    assert max(plan.memory_per_device) <= cap
    at_ref = _plan(model, x, microbatches=ref)          # the reference's own workspace, unbudgeted
    stages = plan.memory_breakdown["params+grads+optimizer"] + plan.memory_breakdown["activations"]
    assert plan.memory_breakdown["transient"] < at_ref.memory_breakdown["transient"]
    assert stages + at_ref.memory_breakdown["transient"] > cap       # the reference's room: this cut refused


def test_the_refusal_lists_the_counts_that_came_closest_first(monkeypatch):
    """Each count's (peak, room) as ``_partition`` saw them (the last ranking's): the note's reasons are
    ordered by peak / room, a count with no room at all last."""
    model, x = _job()
    traced = trace(model, (x,), lm_loss, x)
    retracer = Retracer(model, (x,), lm_loss, x, None, None)
    cand = pipeline_candidates(traced, autopar.Mesh((2,), axis_names=("pp",), device="h100"),
                               ParallelMode.SEMI_AUTO, {})[0][0]
    seen = {}
    real = ps._partition

    def partition(costs, batch, pp, m, schedule, budget, link, fixed, *rest):
        try:
            return real(costs, batch, pp, m, schedule, budget, link, fixed, *rest)
        except ps.StageMemoryError as err:
            seen[f"{schedule} m={m}"] = (err.state + err.activations) / budget if budget > 0 else float("inf")
            raise

    monkeypatch.setattr(ps, "_partition", partition)
    with pytest.raises(ValueError, match="no pipeline partition fits") as info:
        ps.plan_pipeline(traced, cand, ParallelMode.SEMI_AUTO, PlanOptions(memory_budget_gb=0.03, recompute="none"),
                         {}, {}, retracer)
    listed = re.findall(r"(\w+ m=\d+): no partition", str(info.value))
    assert len(listed) == 3 and set(listed) <= set(seen), (listed, seen)
    assert [seen[k] for k in listed] == sorted(seen.values())[:3], (listed, seen)
