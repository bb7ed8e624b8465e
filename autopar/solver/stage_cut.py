"""One pipeline candidate's stage cut at a microbatch count and schedule, by its unit costs
(``pipeline_search``'s ranking and re-solves), and the step the cut reaches without the memory cap
(``free_step``, ``free_estimate``: what the search's retries with more recomputation compare with the
best plan, ``search._retries``)."""
from __future__ import annotations

import math

from autopar.solver.end_units import rules_at
from autopar.solver.inter_op import CutRules, partition_stages
from autopar.solver.unit_costs import UnitCosts
from autopar.solver.virtual_stages import best_over_virtual_stages, virtual_stage_choices


def partition_at(costs: UnitCosts, batch: int, pp: int, m: int, schedule: str, budget, link, rules: CutRules):
    """(partition, step, optimizer seconds) at m microbatches; interleaved: the best over the v values
    ``virtual_stage_choices`` names (``rules.virtual_stages``: the one the user fixed)."""
    profiles = costs.at(batch, m)

    def cut(v):
        part = partition_stages(profiles, pp, m, schedule, memory_budget=budget, p2p_link=link,
                                rules=rules_at(rules, schedule, pp, v, len(profiles)), virtual_stages=v)
        sync, opt = [0.0] * pp, [0.0] * pp
        for s in part.stages:                       # a rank runs every stage it holds (interleaved: v of them)
            a, b = s.layers
            sync[s.rank] += sum(costs.sync[a:b])
            opt[s.rank] += sum(costs.optimizer[a:b])
        return part, part.step_time + max(a + b for a, b in zip(sync, opt)), max(opt)
    if schedule != "interleaved_1f1b":
        return cut(None)
    return best_over_virtual_stages(cut, virtual_stage_choices(pp, m, len(profiles), rules.virtual_stages))


def free_step(costs: UnitCosts, batch: int, pp: int, m: int, schedule: str, link, rules: CutRules) -> float:
    """The step of the stage cut without the memory cap (inf where no cut exists). When it is under
    the plan's step the cap shaped the cut (``Plan.memory_bound``): the search then tries the
    candidate with more recomputation too (``search._frontier``'s retries), which may balance the
    stages that memory skewed."""
    try:
        _, free, _ = partition_at(costs, batch, pp, m, schedule, math.inf, link, rules)
    except ValueError:
        return math.inf
    return free


def free_estimate(costs: UnitCosts, batch: int, pp: int, counts, kinds, link, rules: CutRules) -> float:
    """The best step over the schedules and microbatch counts with every stage cut by time alone
    (no memory cap), by one solve's unit costs: what the candidate could reach if recomputation
    made room (recomputation only adds time). An estimate: the costs are those of a layout solved
    under this recompute choice's budget."""
    best = math.inf
    for schedule in kinds:
        for m in counts:
            if schedule == "interleaved_1f1b" and m % pp:
                continue
            best = min(best, free_step(costs, batch // m, pp, m, schedule, link, rules))
    return best
