"""Pictures of a plan (PNG): memory per device, the alternatives considered, the pipeline timeline.

``save_pictures(plan, folder)`` writes those that apply (``plan.save_pictures``; ``autopar plan
--out DIR`` calls it) and returns their paths; one function per picture takes a plan and a path.
matplotlib is optional (``pip install 'autopar[plot]'``): it is imported only here, when drawing,
and figures are drawn on their own Agg canvas (``matplotlib.figure.Figure``), so pyplot's global
backend and figure list are left alone.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from autopar.report.device_memory import device_groups, rank_runs
from autopar.core.units import human_bytes
from autopar.report.pipeline import plan_schedule
from autopar.schedules.schedule import simulate
from autopar.cost_models.devices import mesh_device
from autopar.plan.degree_keys import degrees_text
from autopar.plan.views import register_view

INSTALL = "pip install 'autopar[plot]'"
MEMORY, ALTERNATIVES, TIMELINE = "memory.png", "alternatives.png", "pipeline_timeline.png"
CAPTIONS = {MEMORY: "predicted peak memory per device, by part, against the device's capacity",
            ALTERNATIVES: "predicted step time and memory of the plans considered (the chosen one starred)",
            TIMELINE: "the pipeline schedule with predicted stage times (forward, backward, idle)"}
PART_COLORS = {"parameters": "#4C72B0", "gradients": "#DD8452", "optimizer state": "#55A868",
               "activations": "#C44E52"}
OTHER_COLORS = ["#8172B3", "#937860", "#DA8BC3", "#8C8C8C", "#CCB974", "#64B5CD"]
REPEATS = "repeats work on a mesh axis"
IDLE, IDLE_EDGE = "#fbecec", "#dcaaaa"      # the bubble: pale red, hatched
MAX_NUMBERED = 15       # alternatives numbered in the key; the others are drawn unnumbered


class PicturesUnavailable(ImportError):
    """matplotlib is not installed: the pictures cannot be drawn (the plan and its text report can)."""


def _figure_class():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PicturesUnavailable(f"drawing a plan's pictures needs matplotlib, which is not installed: "
                                  f"{INSTALL}") from None
    return Figure


def _figure(width: float, height: float):
    return _figure_class()(figsize=(width, height), layout="constrained")


def _save(fig, path) -> Path:
    """Write the PNG whole or not at all (a temporary file in the same folder, renamed)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png", dpi=110)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _unit(nbytes: float) -> tuple[str, float]:
    """The binary unit the largest value of a picture fills."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return unit, scale
    return "B", 1.0


def _capacity(plan) -> tuple[float, str]:
    """Bytes per device the plan was fitted to, and what to call them."""
    device = mesh_device(plan.mesh)
    cap = plan.memory_budget or device.memory_bytes
    what = f"{device.name} capacity" if cap == device.memory_bytes else "memory budget"
    return cap, f"{what} {human_bytes(cap)}"


def _degrees(degrees: dict) -> str:
    return degrees_text(degrees) or "-"


def _shows_cap(peak: float, cap: float) -> bool:
    """Draw the capacity line to scale only when it leaves the bars readable."""
    return peak >= 0.15 * cap


def _cap_handle(label: str):
    """A legend entry for a capacity line that is not drawn because it is off the scale."""
    from matplotlib.lines import Line2D

    return Line2D([], [], color="black", linestyle="--", linewidth=1.2, label=label)


def save_memory(plan, path) -> Path:
    """Stacked bars of each device group's predicted peak (parameters, gradients, optimizer state,
    activations, the other terms) against the capacity line."""
    groups = device_groups(plan)
    if not groups:
        raise ValueError("this plan predicts no memory per device (plan.memory_per_device is empty): nothing to draw")
    peak = max(g.total for g in groups)
    cap, cap_label = _capacity(plan)
    to_scale = _shows_cap(peak, cap)
    unit, scale = _unit(max(peak, cap) if to_scale else peak)
    names = list(dict.fromkeys(k for g in groups for k in g.parts))
    others = iter(OTHER_COLORS * 4)
    colors = {k: PART_COLORS.get(k) or next(others) for k in names}
    fig = _figure(min(22.0, max(7.0, 3.5 + 1.0 * len(groups))), 4.8)
    ax = fig.add_subplot()
    xs = range(len(groups))
    bottom = [0.0] * len(groups)
    top = max(peak, cap if to_scale else 0.0) / scale * 1.15
    handles = []
    for name in names:
        heights = [g.parts.get(name, 0.0) / scale for g in groups]
        handles.insert(0, ax.bar(xs, heights, 0.6, bottom=bottom, color=colors[name], label=name, edgecolor="white",
                                 linewidth=0.6))     # the legend lists the top part first, as stacked
        for x, h, b in zip(xs, heights, bottom):
            if h > 0.07 * top:
                ax.text(x, b + h / 2, f"{h:.3g}", ha="center", va="center", fontsize=8, color="white")
        bottom = [b + h for b, h in zip(bottom, heights)]
    for x, g in zip(xs, groups):
        share = f"\n{100 * g.total / cap:.3g}% of cap" if to_scale else ""
        ax.text(x, g.total / scale + 0.01 * top, f"{g.total / scale:.3g} {unit}{share}", ha="center", va="bottom",
                fontsize=8)
    if to_scale:
        handles.append(ax.axhline(cap / scale, color="black", linestyle="--", linewidth=1.2, label=cap_label))
    else:
        handles.append(_cap_handle(f"{cap_label}:\noff the scale (the fullest\ndevice uses "
                                   f"{100 * peak / cap:.2g}% of it)"))
    ax.set_ylim(0, top)
    pad = max(0.0, (3 - len(groups)) / 2)
    ax.set_xlim(-0.6 - pad, len(groups) - 0.4 + pad)
    ax.set_xticks(list(xs), [g.label(plan.mesh.size) for g in groups], fontsize=8)
    ax.set_ylabel(f"predicted peak memory per device ({unit})")
    ax.set_title(f"Predicted peak memory per device\n{_degrees(plan.degrees)}, memory options: "
                 f"{plan.memory_options.summary()}", fontsize=10)
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def _alt_label(note: str, microbatches: int, schedule: str, options: str) -> str:
    parts = [note.removeprefix("mesh ")]
    if schedule not in ("none", "", None):
        parts.append(f"{microbatches} × {schedule}")
    if options not in ("none", "", None):
        parts.append(options)
    return ", ".join(parts)


def save_alternatives(plan, path) -> Path:
    """Predicted step time against peak memory per device of every plan the search kept: the chosen
    one starred, those that repeat work on a mesh axis hollow, any over memory crossed, the cap as a
    line; a numbered key beside it, with the candidates that could not be planned."""
    if not plan.alternatives:
        raise ValueError("this plan lists no alternatives (an AUTO search keeps the plans it compared): nothing to "
                         "draw")
    drawn = sorted((a for a in plan.alternatives if math.isfinite(a.step_time) and math.isfinite(a.memory)),
                   key=lambda a: a.step_time)
    unplanned = [a for a in plan.alternatives if not (math.isfinite(a.step_time) and math.isfinite(a.memory))]
    numbered = drawn[:MAX_NUMBERED - 1]
    mesh = " × ".join(f"{n}={s}" for n, s in zip(plan.mesh.axis_names, plan.mesh.shape))
    key = _alternatives_key(_alt_label(mesh + (f" ({plan.candidate})" if plan.candidate else ""), plan.microbatches,
                                       plan.schedule, plan.memory_options.summary()),
                            numbered, len(drawn), unplanned)
    chosen = (max(plan.memory_per_device or [0.0]), plan.step_time)
    cap, cap_label = _capacity(plan)
    peak = max([chosen[0]] + [a.memory for a in drawn])
    to_scale = _shows_cap(peak, cap)
    unit, scale = _unit(max(peak, cap) if to_scale else peak)
    xmax = max(peak, cap) / scale * 1.08 if to_scale else peak / scale * 1.15
    ymax = max([chosen[1]] + [a.step_time for a in drawn]) * 1e3 * 1.12
    key_width = 0.4 + 0.062 * min(100, max(map(len, key)))
    fig = _figure(7.5 + key_width, 5.2)
    ax, side = fig.subplots(1, 2, width_ratios=[7.5, key_width])
    kinds = {"fits": dict(marker="o", color="#4C72B0"),
             REPEATS: dict(marker="o", facecolors="none", edgecolors="#4C72B0"),
             "does not fit memory": dict(marker="X", color="#C44E52")}
    kind_of = {id(a): "does not fit memory" if not a.fits else REPEATS if a.redundant_axes else "fits" for a in drawn}
    for what, style in kinds.items():
        pts = [a for a in drawn if kind_of[id(a)] == what]
        if pts:
            ax.scatter([a.memory / scale for a in pts], [a.step_time * 1e3 for a in pts], s=42, label=what, zorder=3,
                       **style)
    ax.scatter([chosen[0] / scale], [chosen[1] * 1e3], marker="*", s=260, color="#F2B01E", edgecolors="black",
               linewidths=0.8, zorder=4, label="chosen")
    points = [(chosen[0] / scale, chosen[1] * 1e3)] + [(a.memory / scale, a.step_time * 1e3) for a in numbered]
    for (x, y), numbers in _nearby(points, xmax, ymax):
        ax.annotate(",".join(map(str, numbers)), (x, y), textcoords="offset points", xytext=(7, 5), fontsize=8,
                    fontweight="bold" if 1 in numbers else "normal")
    if to_scale:
        ax.axvline(cap / scale, color="black", linestyle="--", linewidth=1.2, label=cap_label)
    handles = ax.get_legend_handles_labels()[0]
    if not to_scale:
        handles.append(_cap_handle(f"{cap_label}: off the scale"))
    ax.legend(handles=handles, fontsize=8, loc="lower right")
    ax.set_xlim(0, xmax)
    ax.set_ylim(0, ymax)
    ax.set_xlabel(f"predicted peak memory per device, fullest device ({unit})")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title("Plans considered (least step time that fits memory wins)", fontsize=10)
    ax.grid(alpha=0.3)
    side.axis("off")
    side.text(0.0, 1.0, "\n".join(key), family="monospace", fontsize=7.5, ha="left", va="top",
              transform=side.transAxes)
    return _save(fig, path)


def _alternatives_key(chosen: str, numbered: list, drawn: int, unplanned: list) -> list[str]:
    """The key's lines: the chosen plan as 1, then the numbered alternatives, then what was not drawn."""
    key = [f" 1  {chosen}  (chosen)"]
    key += [f"{i:>2}  {_alt_label(a.note, a.microbatches, a.schedule, a.memory_options)}"
            + ("" if a.fits else "  (does not fit)") for i, a in enumerate(numbered, start=2)]
    if drawn > len(numbered):
        key.append(f"    ... {drawn - len(numbered)} more, unnumbered")
    if unplanned:
        key += ["", f"not drawn: {len(unplanned)} candidate{'s' * (len(unplanned) > 1)} without a plan"]
        key += [f"  {_short(a.note, 72)}" for a in unplanned[:4]]
        key += [f"  ... {len(unplanned) - 4} more"] if len(unplanned) > 4 else []
    return key


def _nearby(points: list[tuple[float, float]], xmax: float, ymax: float) -> list[tuple[tuple, list[int]]]:
    """Points numbered from 1, those closer than 2% of the axes to an earlier one labelled with it."""
    out: list[tuple[tuple, list[int]]] = []
    for i, (x, y) in enumerate(points, start=1):
        for (ox, oy), numbers in out:
            if abs(x - ox) < 0.02 * xmax and abs(y - oy) < 0.03 * ymax:
                numbers.append(i)
                break
        else:
            out.append(((x, y), [i]))
    return out


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


@register_view("save_timeline")
def save_timeline(plan, path) -> Path:
    """The pipeline schedule as a Gantt chart: one row per pipeline rank, a box per forward and
    backward of a microbatch at its predicted time, idle time (the bubble) hatched, and the gradient
    sync and optimizer step after it."""
    if not plan.stages:
        raise ValueError("this plan has no pipeline stages (degrees['pp'] == 1): there is no timeline to draw")
    fig_class = _figure_class()
    from matplotlib.patches import Patch

    sched = plan_schedule(plan)
    sim = simulate(sched, [s.fwd for s in plan.stages], [s.bwd for s in plan.stages],
                   [s.send_time for s in plan.stages[:-1]])
    tail = max(0.0, plan.step_time - sim.step_time)
    end = (sim.step_time + tail) * 1e3
    per_rank = max(len(a) for a in sched.actions)
    width = min(22.0, max(7.0, 0.42 * per_rank + 2.5))
    fig = fig_class(figsize=(width, min(24.0, 1.3 + 0.55 * sched.num_ranks)), layout="constrained")
    ax = fig.add_subplot()
    palette = [f"C{i}" for i in range(10)]
    px_per_ms = (width - 2.5) / max(end, 1e-12)
    for r in range(sched.num_ranks):
        ax.barh(r, sim.step_time * 1e3, height=0.8, color=IDLE, hatch="xx", edgecolor=IDLE_EDGE, linewidth=0)
    for a, start in sim.start_times.items():
        dur = (sim.end_times[a] - start) * 1e3
        r = sched.rank_of(a.stage)
        fwd = a.kind == "F"
        ax.barh(r, dur, left=start * 1e3, height=0.8, color=palette[a.microbatch % 10], alpha=1.0 if fwd else 0.45,
                hatch=None if fwd else "//", edgecolor="black", linewidth=0.5)
        text = str(a) if sched.virtual_stages > 1 else f"{a.kind}{a.microbatch}"
        if dur * px_per_ms > 0.09 * len(text):
            ax.text(start * 1e3 + dur / 2, r, text, ha="center", va="center", fontsize=7)
    if tail:
        ax.axvspan(sim.step_time * 1e3, end, color="#bbbbbb")
        ax.text((sim.step_time + tail / 2) * 1e3, (sched.num_ranks - 1) / 2, "gradient sync + optimizer",
                rotation=90, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(sched.num_ranks), [_rank_row(plan, sched, r) for r in range(sched.num_ranks)], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel("predicted time in one training step (ms)")
    fig.legend(handles=[Patch(facecolor="C0", edgecolor="black", label="forward (color: microbatch)"),
                       Patch(facecolor="C0", alpha=0.45, hatch="//", edgecolor="black", label="backward"),
                       Patch(facecolor=IDLE, hatch="xx", edgecolor=IDLE_EDGE, label="idle (bubble)")],
               fontsize=7, loc="outside lower center", ncols=3, frameon=False)
    ax.set_title(f"Pipeline: {plan.schedule}, {len(plan.stages)} stages on {sched.num_ranks} ranks, "
                 f"{plan.microbatches} microbatches, bubble {100 * sim.bubble_fraction:.1f}%", fontsize=10)
    return _save(fig, path)


def _rank_row(plan, sched, r: int) -> str:
    stages = [s for s in plan.stages if sched.rank_of(s.index) == r]
    which = ("stage " if len(stages) == 1 else "stages ") + ",".join(str(s.index) for s in stages)
    devices = sorted({d for s in stages for d in s.ranks})
    return f"pp rank {r}: {which}\n" + ("device " if len(devices) == 1 else "devices ") + rank_runs(devices)


@register_view("save_pictures")
def save_pictures(plan, folder) -> list[Path]:
    """Write the pictures that apply to ``plan`` into ``folder`` (made if missing): memory.png always,
    alternatives.png when the plan lists alternatives that were planned, pipeline_timeline.png when
    it is pipelined.
    Raises ``PicturesUnavailable`` (an ImportError) when matplotlib is not installed."""
    _figure_class()                 # without matplotlib, fail before making the folder
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    if plan.memory_per_device:
        out.append(save_memory(plan, folder / MEMORY))
    if any(math.isfinite(a.step_time) for a in plan.alternatives):
        out.append(save_alternatives(plan, folder / ALTERNATIVES))
    if plan.stages:
        out.append(save_timeline(plan, folder / TIMELINE))
    return out


def picture_lines(paths: list[Path]) -> list[str]:
    """Report lines naming each picture written and what it shows."""
    return ["pictures:"] + [f"  {p.name:<24} {CAPTIONS.get(p.name, '')}" for p in paths]
