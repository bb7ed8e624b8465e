"""The pipeline part of a plan's report: stages, bubble and the schedule grid (its timeline PNG:
``report_pictures.save_timeline``)."""
from __future__ import annotations

from autopar.schedules.schedule import Schedule, build_schedule


def plan_schedule(plan) -> Schedule:
    v = plan.pipeline.virtual_stages if plan.pipeline else 1
    return build_schedule(plan.schedule, plan.degrees.get("pp", 1), plan.microbatches, v)


def _ms(t: float) -> str:
    return f"{t * 1e3:.3f} ms"


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f} MiB"


def _layers(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)})"


def render_pipeline(plan) -> list[str]:
    """Report lines: per-stage table, bubble fraction and the step × rank schedule grid."""
    if not plan.stages:
        return []
    info = plan.pipeline
    sched = plan_schedule(plan)
    lines = [f"pipeline: {len(plan.stages)} stages on pp={plan.degrees.get('pp')} ranks, {plan.microbatches} "
             f"microbatches of {info.microbatch_size if info else '?'} samples, schedule {plan.schedule}"
             f"{f' ({info.virtual_stages} virtual stages per rank)' if info and info.virtual_stages > 1 else ''}, "
             f"bubble {100 * (info.bubble_fraction if info else 0.0):.1f}%, schedule critical path "
             f"{_ms(info.pipeline_time if info else 0.0)} (+ gradient sync + optimizer = step {_ms(plan.step_time)})",
             f"  {'stage':<6} {'ranks':<14} {'layers':<28} {'fwd/mb':>11} {'bwd/mb':>11} {'p2p':>11} {'memory':>12}"]
    for s in plan.stages:
        ranks = ",".join(str(r) for r in s.ranks)
        lines.append(f"  {s.index:<6} {ranks:<14} {_layers(s.layers):<28} {_ms(s.fwd):>11} {_ms(s.bwd):>11} "
                     f"{_ms(s.send_time):>11} {_mib(s.memory):>12}")
    lines.append("schedule (step × pipeline rank; 1F0 = stage 1 forward of microbatch 0, "
                 "backward takes 2 steps, '.' = idle):")
    lines += ["  " + row for row in str(sched).splitlines()]
    return lines

