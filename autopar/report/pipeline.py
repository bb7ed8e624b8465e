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


def rank_list(ranks: list[int]) -> str:
    """Ranks for the stage table: runs of consecutive ranks as ``a-b`` ("0-1023"), an evenly strided list
    of more than 4 as ``a,b,..,z (n ranks)``, and more than 4 runs as the first 3, ``..``, the last and
    the count."""
    rs = sorted(ranks)
    if len(rs) > 4 and rs[1] - rs[0] > 1 and all(b - a == rs[1] - rs[0] for a, b in zip(rs, rs[1:])):
        return f"{rs[0]},{rs[1]},..,{rs[-1]} ({len(rs)} ranks)"
    runs: list[list[int]] = []
    for r in rs:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    if len(text) > 4:
        return ",".join(text[:3]) + f",..,{text[-1]} ({len(rs)} ranks)"
    return ",".join(text)


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
        ranks = rank_list(s.ranks)
        lines.append(f"  {s.index:<6} {ranks:<14} {_layers(s.layers):<28} {_ms(s.fwd):>11} {_ms(s.bwd):>11} "
                     f"{_ms(s.send_time):>11} {_mib(s.memory):>12}")
    lines.append("schedule (step × pipeline rank; 1F0 = stage 1 forward of microbatch 0, "
                 "backward takes 2 steps, '.' = idle):")
    lines += ["  " + row for row in str(sched).splitlines()]
    return lines

