"""Benchmark (issues 13, 14): plan the issue-13 jobs on simulated clusters, on the meta device.

Prints, per job, the wall time of ``autopar.plan(mode="auto")`` and AUTO's plan (degrees, memory
options, predicted step time, peak memory per device); ``--progress`` shows the live search line.

    PYTHONPATH=. .venv/bin/python bench/plan_jobs.py [--jobs 1.3b,6.7b,llama7b] [--progress] [--time-budget S]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from examples import factories  # noqa: E402

JOBS = {
    "1.3b": ("GPT 1.3B, batch 512, fp32", lambda: factories.gpt_1_3b(batch=512), 4, "v100-16gb", None),
    "6.7b": ("GPT 6.7B, batch 512, fp32", factories.gpt_6_7b, 16, "v100-16gb", None),
    "llama7b": ("Llama 7B, seq 4096, batch 256, bf16 mixed", factories.llama_7b, 16, "h100", "bf16"),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", default=",".join(JOBS))
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--time-budget", type=float, default=None)
    args = ap.parse_args()
    for key in args.jobs.split(","):
        title, factory, n, device, mp = JOBS[key]
        model, inputs, loss, target = factory()
        t0, c0 = time.perf_counter(), time.process_time()
        p = autopar.plan(model, autopar.Mesh(n, device=device), example_inputs=inputs, loss_fn=loss,
                         example_target=target, mode="auto", mixed_precision=mp, progress=args.progress,
                         time_budget=args.time_budget)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        d = p.degrees
        print(f"{title} on {n} x {device}: {wall:.1f} s ({cpu:.1f} s CPU, load {os.getloadavg()[0]:.1f}) | dp={d['dp']} tp={d['tp']} pp={d['pp']} "
              f"microbatches={p.microbatches} {p.schedule} | {p.memory_options.summary()} | "
              f"step {p.step_time:.2f} s | peak {max(p.memory_per_device) / 2**30:.2f} GiB"
              + (f" | {p.search_note}" if p.search_note else ""), flush=True)


if __name__ == "__main__":
    main()
