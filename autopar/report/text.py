"""Human-readable plan report and ``plan.explain``."""
from __future__ import annotations

from collections import Counter, defaultdict

from autopar.plan.degree_keys import degrees_text
from autopar.report.context_lines import context_lines
from autopar.report.memory_explain import explain_lines
from autopar.report.sequence_parallel import sequence_parallel_lines
from autopar.sharding.placements import Shard
from autopar.plan.views import register_view


def _gb(b: float) -> str:
    return f"{b / 2**30:.3f} GiB" if b >= 2**24 else f"{b / 2**20:.2f} MiB"


def _ms(t: float) -> str:
    return f"{t * 1e3:.3f} ms"


@register_view("report")
def render(plan) -> str:
    lines = _header_lines(plan)
    lines += _param_lines(plan)
    lines.append("")
    lines += _op_lines(plan)
    lines.append("")
    lines += _collective_lines(plan)
    if plan.unknown_ops:
        lines.append("")
        lines.append("ops without a sharding rule (run replicated): " +
                     ", ".join(sorted(set(plan.unknown_ops.values()))))
    if plan.memory_breakdown:
        lines.append("")
        lines.append("memory per device: " + ", ".join(f"{k} {_gb(v)}" for k, v in plan.memory_breakdown.items()))
        lines.append(f"memory options: {plan.memory_options.summary()}; ZeRO over the axes each parameter is "
                     "replicated on would save, per rank:")
        lines += explain_lines(plan)
    if plan.stages:
        from autopar.report.pipeline import render_pipeline

        lines.append("")
        lines += render_pipeline(plan)
    if plan.alternatives:
        lines.append("")
        lines += _alternative_lines(plan)
    if plan.autotune:
        lines.append("")
        lines += _autotune_lines(plan)
    return "\n".join(lines)


def _header_lines(plan) -> list[str]:
    m = plan.mesh
    return [f"autopar plan — mode {plan.mode.name}",
            f"mesh: {' × '.join(f'{n}={s}' for n, s in zip(m.axis_names, m.shape))} ({m.size} devices, {m.device})",
            f"degrees: {degrees_text(plan.degrees)}"
            f"   microbatches={plan.microbatches} schedule={plan.schedule}",
            *context_lines(plan),
            *_redundant_lines(plan),
            *sequence_parallel_lines(plan),
            f"memory options: {plan.memory_options.summary()}",
            f"programs: {'compiled (torch.compile, inductor)' if plan.compiled else 'eager'}",
            f"predicted step time: {_ms(plan.step_time)}   FLOPs/step: {plan.flops:.3e}   "
            f"peak memory/device: {_gb(max(plan.memory_per_device or [0]))}",
            f"solver: {plan.solver_status} in {plan.solve_time:.2f}s",
            *([f"note: {plan.search_note}"] if plan.search_note else []), ""]


def _param_lines(plan) -> list[str]:
    lines = ["parameters (placement per mesh axis; gradient sync axes):"]
    for name, d in plan.params.items():
        if d.kind != "parameter":
            continue
        tied = f"  tied: {', '.join(d.aliases)}" if len(d.aliases) > 1 else ""
        sync = f"  grad all-reduce over {'+'.join(d.grad_sync)}" if d.grad_sync else ""
        lines.append(f"  {name:<40} {str(d.shape):<16} {d.spec}{sync}{tied}")
    return lines


def _op_lines(plan) -> list[str]:
    """The ops grouped by module, each module pattern (repeated layers) shown once, at most 80."""
    lines = ["ops by module type (strategy, output placement, predicted time; repeated layers shown once):"]
    by_mod = defaultdict(list)
    for name, d in plan.nodes.items():
        by_mod[d.module or "<root>"].append((name, d))
    shown: dict[str, int] = {}
    for mod in by_mod:
        shown[_pattern(mod)] = shown.get(_pattern(mod), 0) + 1
    printed = set()
    for mod, items in by_mod.items():
        pat = _pattern(mod)
        if pat in printed:
            continue
        printed.add(pat)
        count = shown[pat]
        lines.append(f"  {pat}" + (f"   (×{count}, like {mod})" if count > 1 else ""))
        for name, d in items:
            op = d.op.replace("aten.", "").replace(".default", "")
            out = ",".join(str(o) for o in d.output) if isinstance(d.output, list) else str(d.output)
            lines.append(f"    {name:<28} {op:<30} {d.strategy:<14} {out:<14} {_ms(d.time)}")
        if len(printed) >= 80:
            lines.append("  ... more modules (see plan.nodes)")
            break
    return lines


def _collective_lines(plan) -> list[str]:
    colls = plan.collectives(0)
    agg = Counter()
    size = Counter()
    t = Counter()
    for c in colls:     # a pipeline lists one microbatch's activation collectives (sends/receives too)
        times = plan.runs_per_step(c)   # separate lines for once-per-step and per-microbatch entries
        key = (c.kind, "+".join(c.axes), c.phase, times)
        agg[key] += times
        size[key] += c.bytes * times
        t[key] += c.time * times
    lines = [f"collectives per step on rank 0: {sum(agg.values())}"]
    for key, n in sorted(agg.items()):
        each = f" ({n // key[3]} × {key[3]} microbatches)" if key[3] > 1 else ""
        lines.append(f"  {key[0]:<15} axis {key[1]:<6} {key[2]:<4} ×{n:<4} {_gb(size[key]):>12}  {_ms(t[key])}{each}")
    return lines


def _alternative_lines(plan) -> list[str]:
    lines = ["why this plan — alternatives considered (least step time that fits memory wins; a plan "
             "that repeats the work on an axis only where every plan does):",
             f"  {'degrees':<28} {'microbatches':<20} {'step time':>12} {'of it optim':>12} {'memory':>12}  "
             f"{'memory options':<24}  fits  note"]
    opt = plan.optimizer_time or 0.0
    lines.append(f"  {_deg(plan.degrees):<28} {_mb(plan.microbatches, plan.schedule):<20} {_ms(plan.step_time):>12} "
                 f"{_ms(opt):>12} {_gb(max(plan.memory_per_device or [0])):>12}  "
                 f"{plan.memory_options.summary():<24}  yes   chosen"
                 + (f" ({plan.candidate})" if plan.candidate else ""))
    for a in plan.alternatives[:10]:
        lines.append(f"  {_deg(a.degrees):<28} {_mb(a.microbatches, a.schedule) if a.fits else '-':<20} "
                     f"{_ms(a.step_time) if a.fits else '-':>12} {_ms(a.optimizer_time) if a.fits else '-':>12} "
                     f"{_gb(a.memory) if a.fits else '-':>12}  {a.memory_options if a.fits else '-':<24}  "
                     f"{'yes' if a.fits else 'no ':<4}  {a.note}"
                     + (f"; repeats work on {'+'.join(a.redundant_axes)}" if a.redundant_axes else ""))
    return lines


def _autotune_lines(plan) -> list[str]:
    lines = ["measured on the ranks (autotune_top_k): the fastest measured of the best predicted wins; "
             f"timed {plan.autotune_timing or 'interleaved'}",
             f"  {'plan':<44} {'predicted':>12} {'measured':>12} {'steps':>6}"]
    for t in plan.autotune:
        measured = _ms(t.measured) if t.measured is not None else "failed"
        note = "  chosen" if t.chosen else ""
        lines.append(f"  {t.label:<44} {_ms(t.predicted):>12} {measured:>12} {t.steps:>6}{note}")
        if t.error:
            lines.append(f"      not built: {t.error}")
    return lines


def _redundant_lines(plan) -> list[str]:
    size = dict(zip(plan.mesh.axis_names, plan.mesh.shape))
    out = []
    for a in plan.redundant_axes():
        shares = plan.axis_shares.get(a, {})
        split = 1.0 - shares.get("none", 1.0)
        what = (f"only {split * 100:.2g}% of the compute (FLOPs) is split on it — every rank on it repeats the rest"
                if split > 0 else "no op is split on it — every rank on it repeats the same work")
        stored = any(d.kind == "parameter" and isinstance(d.spec[plan.mesh.axis_index(a)], Shard)
                     for d in plan.params.values())
        out.append(f"axis {a} (size {size[a]}): {what}"
                   + (" (parameters are stored split on it: that saves memory only)" if stored else ""))
    return out


def _mb(microbatches: int, schedule: str) -> str:
    return "-" if schedule in ("none", "", None) else f"{microbatches} × {schedule}"


def _pattern(module: str) -> str:
    """``blocks.3.attn`` -> ``blocks.*.attn``: one entry per layer type."""
    return ".".join("*" if part.isdigit() else part for part in module.split("."))


def _deg(d: dict) -> str:
    return degrees_text(d) or "-"


@register_view("explain")
def explain(plan, name: str) -> str:
    if name in plan.params:
        d = plan.params[name]
        users = [n for n, nd in plan.nodes.items() if d.placeholder in n]
        head = (f"{name}: placement {d.spec} over axes {plan.mesh.axis_names}; shape {d.shape}; "
                f"gradient all-reduce over {d.grad_sync or 'none'}" + (f"; users {users}" if users else ""))
        if d.kind != "parameter":
            return head
        return "\n".join([head, f"  memory options: {plan.memory_options.summary()}; what each ZeRO stage would "
                                 "do to this parameter on one rank:"] + explain_lines(plan, name))
    if name not in plan.nodes:
        raise KeyError(f"no node or parameter named {name!r} in the plan; nodes look like {list(plan.nodes)[:5]}")
    d = plan.nodes[name]
    lines = [f"{name} ({d.op}, module {d.module or '<root>'}): chose {d.strategy}",
             f"  inputs {', '.join(map(str, d.inputs))} -> output {d.output}",
             "  options (strategy: own time + resharding with the chosen neighbours):"]
    for desc, cost in d.options:
        lines.append(f"    {cost * 1e3:10.4f} ms  {desc}")
    return "\n".join(lines)
