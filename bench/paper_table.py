"""Benchmark (issue 14): Table 1 of Narayanan et al., "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM" (SC'21), planned by autopar on simulated A100-80GB clusters.

For each row (``examples.megatron_table1.TABLE1``: A100-80GB, 8 per node, sequence 2048, vocabulary
51200, the published t, p, GPUs, global batch and measured TFLOP/s per GPU) it prints

* the published (t, p, d) and TFLOP/s per GPU;
* FORCED: autopar's prediction for that same configuration: a named mesh ``pp x dp x tp`` (``dp x tp``
  when p = 1), every parameter replicated over ``dp`` (annotations: plain data parallelism), bf16
  mixed precision, full recomputation and no ZeRO as in the paper, planned in SEMI_AUTO (the
  planner still picks microbatches, schedule and the tensor-parallel layout); what was forced is
  checked in the plan (degrees, memory options) and a mismatch is printed; a PlanError is printed
  as the row's finding;
* AUTO: autopar's own plan on an unnamed mesh of the same GPUs (bf16 mixed precision, everything
  else chosen), its prediction, solve time and search note (``--time-budget``).

TFLOP/s per GPU is counted as the paper does (its eq. 3, with recomputation):
``paper_flops_per_step(row) / plan.step_time / gpus``. The forced plan's step time is broken into
its terms with ``--breakdown`` (``breakdown``: the busiest pipeline rank, summed serially as the cost
model adds them): the FLOP time at the device's modelled efficiency, tensor-parallel collectives,
data-parallel gradient sync, pipeline p2p, optimizer step, pipeline bubble, and the rest
(memory-bound ops, kernel launches, the difference between the planner's work and the paper's count).

Each job (one row's FORCED or AUTO plan) runs in its own process with a hard wall-clock limit and
reports its peak RSS.

    PYTHONPATH=. .venv/bin/python bench/paper_table.py [--rows 1.7,18.4] [--skip-auto] [--skip-forced]
        [--time-budget S] [--hard-timeout S] [--breakdown]
    PYTHONPATH=. .venv/bin/python bench/paper_table.py --table moe [...]   (bench/moe_table.py)
    PYTHONPATH=. .venv/bin/python bench/paper_table.py --table llama3 [...]   (bench/llama3_table.py)
"""
from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from bench.common import run_isolated as run_in_process  # noqa: E402
from autopar.cost_models.devices import get_device  # noqa: E402
from examples.megatron_table1 import TABLE1, Row, model_of, paper_flops_per_step  # noqa: E402

DEVICE, GPUS_PER_NODE = "a100-80gb", 8
TOLERANCE = 0.25            # target: the forced prediction within 25 % of the published figure


def forced_mesh(row: Row) -> autopar.Mesh:
    """The published configuration as a named mesh: ``pp x dp x tp`` (``dp x tp`` when p = 1)."""
    if row.p == 1:
        return autopar.Mesh((row.d, row.t), axis_names=("dp", "tp"), device=DEVICE, gpus_per_node=GPUS_PER_NODE)
    return autopar.Mesh((row.p, row.d, row.t), axis_names=("pp", "dp", "tp"), device=DEVICE,
                        gpus_per_node=GPUS_PER_NODE)


# every parameter of examples.models.GPT, by module glob (lm_head's weight is wte's, tied)
PARAM_MODULES = ("wte", "wpe", "ln_f", "blocks.*.ln1", "blocks.*.ln2", "blocks.*.qkv", "blocks.*.proj",
                 "blocks.*.fc1", "blocks.*.fc2")


def annotate_data_parallel() -> None:
    """Every parameter whole on the ``dp`` axis: plain data parallelism there, as the paper ran it
    (no ZeRO; the solver would otherwise be free to store a parameter split over ``dp``)."""
    for glob in PARAM_MODULES:
        autopar.shard(glob, weight={"dp": autopar.Replicate()}, bias={"dp": autopar.Replicate()})


def plan_forced(row: Row, time_budget: float | None = None, pure_dp: bool = True) -> tuple[autopar.Plan, float]:
    """(plan, wall seconds) of the published (t, p, d) with the paper's memory options; ``pure_dp``:
    every parameter replicated over ``dp`` (``annotate_data_parallel``)."""
    model, inputs, loss, target = model_of(row)
    autopar.set_auto_parallel_context(recompute="full", zero=0, accumulation=None)
    autopar.clear_annotations()
    if pure_dp:
        annotate_data_parallel()
    try:
        t0 = time.perf_counter()
        plan = autopar.plan(model, forced_mesh(row), example_inputs=inputs, loss_fn=loss, example_target=target,
                            mode="semi_auto", mixed_precision="bf16", time_budget=time_budget)
        return plan, time.perf_counter() - t0
    finally:
        autopar.reset_auto_parallel_context()
        autopar.clear_annotations()


def plan_auto(row: Row, time_budget: float | None) -> tuple[autopar.Plan, float]:
    """(plan, wall seconds) of AUTO on an unnamed mesh of ``row.gpus`` A100s (bf16 mixed precision)."""
    model, inputs, loss, target = model_of(row)
    autopar.reset_auto_parallel_context()
    autopar.clear_annotations()
    t0 = time.perf_counter()
    plan = autopar.plan(model, autopar.Mesh(row.gpus, device=DEVICE, gpus_per_node=GPUS_PER_NODE),
                        example_inputs=inputs, loss_fn=loss, example_target=target, mode="auto",
                        mixed_precision="bf16", time_budget=time_budget)
    return plan, time.perf_counter() - t0


def tflops_per_gpu(row: Row, step_time: float) -> float:
    """The paper's FLOPs per step (eq. 3, with recomputation) / step time / GPUs, in TFLOP/s."""
    return paper_flops_per_step(row) / step_time / row.gpus / 1e12


def forced_mismatches(row: Row, plan: autopar.Plan) -> list[str]:
    """What the forced plan does not do as the paper did (empty when all was planned as forced)."""
    out = []
    want = {"dp": row.d, "tp": row.t, "pp": row.p, "ep": 1, "cp": 1}
    if plan.degrees != want:
        out.append(f"degrees {plan.degrees} != {want}")
    mo = plan.memory_options
    if mo.mixed_precision != "bf16":
        out.append(f"mixed_precision {mo.mixed_precision!r}")
    if mo.recompute != "full":
        out.append(f"recompute {mo.recompute!r}")
    if mo.zero != 0:
        out.append(f"ZeRO-{mo.zero}")
    return out


def busiest_rank(plan: autopar.Plan) -> int:
    """The first rank of the pipeline rank whose stages take longest per microbatch (0 without a pipeline)."""
    if not plan.stages:
        return 0
    per_pp = plan.mesh.size // plan.mesh.shape[0]
    busy: dict[int, float] = {}
    for s in plan.stages:
        busy[s.ranks[0] // per_pp] = busy.get(s.ranks[0] // per_pp, 0.0) + s.time
    return max(busy, key=busy.get) * per_pp


def breakdown(row: Row, plan: autopar.Plan) -> dict[str, float]:
    """Seconds per step by term on the busiest rank (``busiest_rank``; collectives summed as if
    serial, as the cost model adds them): ``flop_peak`` (the paper's FLOPs per GPU at the bf16 peak),
    ``flop_eff`` (at the modelled compute efficiency), ``tp``, ``dp`` (gradient sync), ``pp`` (p2p),
    ``other_comm`` (activation collectives on other axes), ``optimizer``, ``bubble`` (pipeline
    idle, including stage imbalance) and ``rest`` = step - all the others but ``flop_peak``."""
    spec = get_device(DEVICE, gpus_per_node=GPUS_PER_NODE)
    peak = spec.peak_flops["bf16"]
    flops = paper_flops_per_step(row) / row.gpus
    params = {d.placeholder for d in plan.params.values()}
    terms = {"flop_peak": flops / peak, "flop_eff": flops / (peak * spec.compute_efficiency),
             "tp": 0.0, "dp": 0.0, "pp": 0.0, "other_comm": 0.0}
    for c in plan.collectives(rank=busiest_rank(plan)):
        t = c.time * plan.runs_per_step(c)
        if c.node in params or c.phase == "step":
            terms["dp"] += t
        elif c.kind in ("send", "recv") or c.axes == ["pp"]:
            terms["pp"] += t
        elif c.axes == ["tp"]:
            terms["tp"] += t
        else:
            terms["other_comm"] += t
    terms["optimizer"] = plan.optimizer_time or 0.0
    terms["bubble"] = plan.pipeline.pipeline_time * plan.pipeline.bubble_fraction if plan.pipeline else 0.0
    terms["rest"] = plan.step_time - sum(v for k, v in terms.items() if k != "flop_peak")
    return terms


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9      # KiB on Linux


def forced_result(row: Row, time_budget: float | None = None) -> dict:
    """One row's FORCED figures (a PlanError is returned as ``error``)."""
    try:
        plan, wall = plan_forced(row, time_budget)
    except Exception as err:  # noqa: BLE001 - a plan that does not fit is a finding, printed in the table
        return {"error": f"{type(err).__name__}: {err}", "rss_gb": _rss_gb()}
    tf = tflops_per_gpu(row, plan.step_time)
    return {"tflops": tf, "ratio": tf / row.tflops, "step": plan.step_time, "microbatches": plan.microbatches,
            "schedule": plan.schedule, "virtual": plan.pipeline.virtual_stages if plan.pipeline else 1,
            "bubble": plan.pipeline.bubble_fraction if plan.pipeline else 0.0,
            "mem_gib": max(plan.memory_per_device) / 2**30, "solve": wall, "mismatch": forced_mismatches(row, plan),
            "flops_ratio": plan.flops / paper_flops_per_step(row), "terms": breakdown(row, plan),
            "options": plan.memory_options.summary(), "note": plan.search_note, "rss_gb": _rss_gb()}


def auto_result(row: Row, time_budget: float | None) -> dict:
    """One row's AUTO figures (an error is returned as ``error``)."""
    try:
        plan, wall = plan_auto(row, time_budget)
    except Exception as err:  # noqa: BLE001
        return {"error": f"{type(err).__name__}: {err}", "rss_gb": _rss_gb()}
    d = plan.degrees
    return {"tflops": tflops_per_gpu(row, plan.step_time), "step": plan.step_time,
            "degrees": f"{d['tp']},{d['pp']},{d['dp']}", "microbatches": plan.microbatches, "schedule": plan.schedule,
            "options": plan.memory_options.summary(), "mem_gib": max(plan.memory_per_device) / 2**30, "solve": wall,
            "note": plan.search_note, "rss_gb": _rss_gb()}


def _worker(kind: str, row: Row, time_budget, queue) -> None:
    try:
        res = forced_result(row, time_budget) if kind == "forced" else auto_result(row, time_budget)
    except BaseException:  # noqa: BLE001
        res = {"error": traceback.format_exc(limit=3), "rss_gb": _rss_gb()}
    queue.put(res)


def run_isolated(kind: str, row: Row, time_budget, hard_timeout: float) -> dict:
    """``forced_result`` / ``auto_result`` in a fresh process, killed after ``hard_timeout`` s."""
    return run_in_process(_worker, (kind, row, time_budget), hard_timeout, {"solve": hard_timeout, "rss_gb": math.nan})


def _fmt_forced(row: Row, f: dict | None) -> str:
    if f is None:
        return "forced: skipped"
    if "error" in f:
        return f"forced: ERROR {f['error'].splitlines()[-1][:300]}"
    mb = f"{f['microbatches']} {f['schedule']}" + (f" v={f['virtual']}" if f["virtual"] > 1 else "")
    flag = "" if abs(f["ratio"] - 1) <= TOLERANCE else " OFF"
    miss = f" MISMATCH {'; '.join(f['mismatch'])}" if f["mismatch"] else ""
    return (f"forced: {f['tflops']:6.1f} TF ({f['ratio']:.2f}x{flag}) | step {f['step']:.2f} s | mb {mb} | "
            f"{f['mem_gib']:.1f} GiB | solve {f['solve']:.1f} s | rss {f['rss_gb']:.2f} GB{miss}"
            + (f" | {f['note']}" if f.get("note") else ""))


def _fmt_auto(a: dict | None, f: dict | None) -> str:
    if a is None:
        return "auto: skipped"
    if "error" in a:
        return f"auto: ERROR {a['error'].splitlines()[-1][:300]} | wall {a.get('wall', math.nan):.1f} s"
    vs = f" ({a['tflops'] / f['tflops']:.2f}x forced)" if f and "tflops" in f else ""
    return (f"auto: t,p,d={a['degrees']} mb {a['microbatches']} {a['schedule']} | {a['options']} | "
            f"{a['tflops']:6.1f} TF{vs} | step {a['step']:.2f} s | {a['mem_gib']:.1f} GiB | solve {a['solve']:.1f} s | "
            f"rss {a['rss_gb']:.2f} GB"
            + (f" | {a['note']}" if a["note"] else ""))


def _fmt_terms(f: dict) -> str:
    t = f["terms"]
    return ("    terms (ms): " + " ".join(f"{k}={v * 1e3:.0f}" for k, v in t.items())
            + f" | planner FLOPs / paper FLOPs {f['flops_ratio']:.3f}")


def main() -> None:
    if "--table" in sys.argv:          # --table moe / llama3: bench/moe_table.py, bench/llama3_table.py
        i = sys.argv.index("--table")
        table, rest = sys.argv[i + 1] if i + 1 < len(sys.argv) else "", sys.argv[1:i] + sys.argv[i + 2:]
        if table == "moe":
            from bench.moe_table import main as moe_main

            return moe_main(rest)
        if table == "llama3":
            from bench.llama3_table import main as llama3_main

            return llama3_main(rest)
        if table != "megatron":
            raise SystemExit(f"--table {table!r}: use 'megatron' (Table 1 of Narayanan et al., the default), 'moe' "
                             "or 'llama3'")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(f"{r.billions:g}" for r in TABLE1),
                    help="comma-separated row names (billions of parameters), e.g. 1.7,18.4")
    ap.add_argument("--skip-auto", action="store_true")
    ap.add_argument("--skip-forced", action="store_true")
    ap.add_argument("--time-budget", type=float, default=60.0, help="AUTO's time_budget (seconds)")
    ap.add_argument("--hard-timeout", type=float, default=None,
                    help="kill a job after this many seconds (default: max(600, 5 x time budget))")
    ap.add_argument("--breakdown", action="store_true", help="print the forced plan's step time by term")
    args = ap.parse_args()
    by_name = {f"{r.billions:g}": r for r in TABLE1}
    rows = [by_name[k.strip()] for k in args.rows.split(",")]
    hard = args.hard_timeout or max(600.0, 5 * args.time_budget)
    print(f"Table 1 of Narayanan et al. (SC'21) on {DEVICE}, {GPUS_PER_NODE} per node; TF = TFLOP/s per GPU = the "
          f"paper's FLOPs (eq. 3, with recomputation) / predicted step / GPUs, for every plan (one that does not "
          f"recompute is credited FLOPs it does not run: compare step times); AUTO time budget "
          f"{args.time_budget:g} s", flush=True)
    results = []
    for row in rows:
        f = None if args.skip_forced else run_isolated("forced", row, None, hard)
        a = None if args.skip_auto else run_isolated("auto", row, args.time_budget, hard)
        results.append((row, f, a))
        print(f"{row.billions:>6g}B  {row.gpus:>4} GPUs  published t,p,d={row.t},{row.p},{row.d} {row.tflops:g} TF | "
              f"{_fmt_forced(row, f)} | {_fmt_auto(a, f)}", flush=True)
        if args.breakdown and f and "terms" in f:
            print(_fmt_terms(f), flush=True)
    _summary(results, args.time_budget)


def _summary(results, budget: float) -> None:
    forced = [(r, f) for r, f, _ in results if f is not None]
    ok_forced = [r for r, f in forced if "ratio" in f and abs(f["ratio"] - 1) <= TOLERANCE]
    autos = [(r, f, a) for r, f, a in results if a is not None]
    ok_auto = [r for r, f, a in autos
               if "tflops" in a and f and "tflops" in f and a["tflops"] >= f["tflops"] * (1 - 1e-9)]
    ok_time = [r for r, _, a in autos if "solve" in a and "error" not in a and a["solve"] <= 60.0]
    rss = [x["rss_gb"] for _, f, a in results for x in (f, a) if x and not math.isnan(x.get("rss_gb", math.nan))]
    print("summary:")
    if forced:
        off = [f"{r.billions:g}B" for r, _ in forced if r not in ok_forced]
        print(f"  forced prediction within {TOLERANCE:.0%} of published: {len(ok_forced)}/{len(forced)} rows"
              + (f" (off: {', '.join(off)})" if off else ""))
    if autos:
        compared = [r for r, f, a in autos if f is not None]
        if compared:
            print(f"  AUTO predicted at least as fast as the forced published configuration: "
                  f"{len(ok_auto)}/{len(compared)} rows (a row whose forced or AUTO plan failed counts as not)")
        print(f"  AUTO solve time <= 60 s: {len(ok_time)}/{len(autos)} rows (time budget {budget:g} s)")
    if rss:
        print(f"  peak RSS of a job: {max(rss):.2f} GB (target < 4 GB)")
    print(f"  peak RSS of this driver: {_rss_gb():.2f} GB", flush=True)


if __name__ == "__main__":
    main()
