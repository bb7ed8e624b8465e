"""The probes after the frontiers (``search.make_plans``): ZeRO-1 on a pipeline found at ZeRO-0
(``zero_upgrade``), then partial recomputation of a plan that recomputes every layer
(``partial_recompute``), on the best plan and on the runner-up: the fastest pipeline of another mesh
that recomputes every layer, within ``RUNNER_UP`` of the best plan's step.

Why a runner-up: each probe refines one candidate, and two pipeline depths can sit within a few
percent of each other before it, in either order. Llama 3 405B at 128K tokens on 16384 H100s: 8
stages at ZeRO-1 with every layer recomputed ran 15.04 s, 16 stages at ZeRO-0 15.27 s; the published
layout, 16 stages at ZeRO-1 with 80 of 126 layers recomputed, runs 14.71 s, and only probes of the
16-stage candidate reach it. A heuristic, like the probes themselves: a candidate further behind is
not refined."""
from __future__ import annotations

from autopar.plan.plan import Plan
from autopar.solver.partial_recompute import applies as partial_applies, partial_plans
from autopar.solver.request import SolveRequest
from autopar.solver.zero_upgrade import applies as zero1_applies, zero1_plans

RUNNER_UP = 0.02    # a runner-up pipeline within this share of the best plan's step is refined too


def runner_up(plans: list[Plan], best: Plan, key) -> Plan | None:
    """The fastest pipeline plan (by ``key``) on another mesh than ``best``'s that recomputes every layer
    and whose step is within ``RUNNER_UP`` of ``best``'s; None when there is none."""
    others = [p for p in plans if p.pipeline is not None and p.memory_options.recompute == "full"
              and (p.mesh.shape, p.mesh.axis_names) != (best.mesh.shape, best.mesh.axis_names)
              and not p.redundant_axes() and p.step_time <= (1 + RUNNER_UP) * best.step_time]
    return min(others, key=key, default=None)


def refined(req: SolveRequest, plans: list[Plan], tried: set[int], zero1_tried, candidates, traces: dict,
            key) -> list[Plan]:
    """The probes' plans (module docstring). ``tried``: the ZeRO stages whose frontier ran;
    ``zero1_tried(plan)``: whether the ZeRO-1 frontier tried ``plan``'s pipeline at its recomputation;
    ``candidates``: ``search._candidates``; ``traces``: accumulation k -> the step traced at B/k;
    ``key``: what the search minimises."""
    progress = req.opts.progress
    best = min(plans, key=key)
    anchors = [best] + [p for p in [runner_up(plans, best, key)] if p is not None]
    out: list[Plan] = []
    for anchor in anchors:
        if progress is not None and progress.out_of_time():
            break
        if zero1_applies(req, tried, zero1_tried(anchor)):      # ZeRO-1 shards the optimizer step (its room)
            got = zero1_plans(req, anchor, traces, candidates)
            out += got
            anchor = min([anchor] + got, key=key)
        if partial_applies(req) and not (progress is not None and progress.out_of_time()):
            out += partial_plans(req, anchor, traces, candidates)     # "full" on fewer layers
    return out
