"""Where a pipelined MoE plan's step goes (bench/RESULTS.md §34e): per stage and microbatch, the
expert all-to-alls, the experts' compute, attention, the rest; the bubble and the once-per-step
part. Reads a plan JSON (``Plan.save``), or makes one: ``--row NAME --out FILE`` plans the row's FORCED layout
with ``bench/moe_table.plan_row`` (what ``paper_table.py --table moe --rows NAME --skip-auto`` runs) and saves it.

    PYTHONPATH=. python bench/moe_breakdown.py plan.json
    PYTHONPATH=. python bench/moe_breakdown.py --row deepseek_v3 --out deepseek.json
"""
from __future__ import annotations

from collections import defaultdict

from autopar.plan.plan import Plan


def _kind(op: str, module: str) -> str:
    if "moe_experts" in op:
        return "experts"
    if "scaled_dot_product" in op or "flash_attention" in op or "efficient_attention" in op:
        return "attention core"
    if "self_attn" in module:
        return "attention projections"
    if ".mlp" in module:
        return "dense MLP / shared experts / router"
    return "other"


def breakdown(plan: Plan) -> str:
    lines = []
    pipe = plan.pipeline
    lines.append(f"step {plan.step_time:.3f} s | {plan.microbatches} microbatches {plan.schedule}"
                 + (f" v={pipe.virtual_stages} bubble {pipe.bubble_fraction:.3f} pipeline {pipe.pipeline_time:.3f} s"
                    if pipe else "") + f" | {plan.memory_options.summary()} | peak {max(plan.memory_per_device) / 2**30:.1f} GiB")
    a2a = defaultdict(float)
    for c in plan.collective_list:
        if c.kind == "all_to_all" and c.node:
            a2a[c.node] += c.time
    for st in plan.stages:
        parts = defaultdict(float)
        for name in st.nodes:
            d = plan.nodes.get(name)
            if d is None:
                continue
            k = _kind(d.op, d.module)
            if k == "experts":
                parts["expert all-to-alls"] += a2a.get(name, 0.0)
                parts["experts compute"] += d.time - a2a.get(name, 0.0)
            else:
                parts[k] += d.time
        total = sum(parts.values())
        layers = len(st.layers)
        lines.append(f"stage {st.index} ({layers} units, ranks {st.ranks[0]}..): fwd {st.fwd:.3f} + bwd {st.bwd:.3f} = "
                     f"{st.fwd + st.bwd:.3f} s per microbatch, send {st.send_time * 1e3:.2f} ms | node times {total:.3f}: "
                     + ", ".join(f"{k} {v:.3f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])))
    if plan.once_per_step_time is not None:
        lines.append(f"once per step (grad sync, optimizer, ZeRO gathers) {plan.once_per_step_time:.3f} s")
    if plan.optimizer_time is not None:
        lines.append(f"optimizer (fullest rank) {plan.optimizer_time:.3f} s")
    mem = plan.memory_breakdown
    if mem:
        lines.append("memory (GiB): " + ", ".join(f"{k} {v / 2**30:.1f}" for k, v in mem.items()
                                                  if isinstance(v, (int, float))))
    return "\n".join(lines)


def main(argv=None) -> None:
    import argparse
    import time

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan", nargs="?", help="a plan JSON to break down")
    ap.add_argument("--row", help="a row of bench/moe_table.MOE_ROWS to plan (FORCED) first")
    ap.add_argument("--out", help="where --row's plan is saved")
    args = ap.parse_args(argv)
    if args.row:
        from bench import moe_table

        row = {r.name: r for r in moe_table.MOE_ROWS + moe_table.EXTRA_ROWS}[args.row]
        t0, c0 = time.perf_counter(), time.process_time()
        plan, _ = moe_table.plan_row(row, True, None)
        tf = moe_table.step_flops(row) / plan.step_time / row.gpus / 1e12
        print(f"{row.name}: {tf:.1f} TF/GPU ({tf / row.tflops:.3f}x of {row.tflops:g}) | plan() "
              f"{time.perf_counter() - t0:.0f} s wall, {time.process_time() - c0:.0f} s CPU")
        if args.out:
            plan.save(args.out)
    else:
        plan = Plan.load(args.plan)
    print(breakdown(plan))


if __name__ == "__main__":
    main()
