"""Benchmark (issue 14): planning time against depth. The same GPT width at 48 and 96 layers,
planned by AUTO on the same simulated cluster, repetitions interleaved; prints each wall time and
the 96/48 ratio (goal <= 2: solve time should grow with distinct layers, not depth).

    PYTHONPATH=. .venv/bin/python bench/depth_scaling.py [--hidden 1600 --heads 25 --mesh 64 --device h100 --reps 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from examples import factories  # noqa: E402


def plan_once(layers: int, args) -> tuple[float, float, autopar.Plan]:
    """(wall seconds, CPU seconds of this process, plan): CPU time is what the search costs even
    when other jobs share the cores."""
    model, inputs, loss, target = factories.gpt(args.hidden, layers, args.heads, args.seq, args.batch)
    t0, c0 = time.perf_counter(), time.process_time()
    plan = autopar.plan(model, autopar.Mesh(args.mesh, device=args.device), example_inputs=inputs, loss_fn=loss,
                        example_target=target, mode="auto")
    return time.perf_counter() - t0, time.process_time() - c0, plan


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1600)
    ap.add_argument("--heads", type=int, default=25)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--mesh", type=int, default=64)
    ap.add_argument("--device", default="h100")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    times: dict[int, list[float]] = {48: [], 96: []}
    cpu: dict[int, list[float]] = {48: [], 96: []}
    for rep in range(args.reps):
        for layers in (48, 96) if rep % 2 == 0 else (96, 48):
            wall, used, plan = plan_once(layers, args)
            times[layers].append(wall)
            cpu[layers].append(used)
            d = plan.degrees
            print(f"rep {rep} layers {layers}: {wall:.1f} s ({used:.1f} s CPU, load {os.getloadavg()[0]:.1f}) | "
                  f"dp={d['dp']} tp={d['tp']} pp={d['pp']} "
                  f"microbatches={plan.microbatches} | {plan.memory_options.summary()} | step {plan.step_time:.3f} s",
                  flush=True)
    m48, m96 = statistics.median(times[48]), statistics.median(times[96])
    ratios = [b / a for a, b in zip(times[48], times[96])]
    print(f"median 48 layers {m48:.1f} s, 96 layers {m96:.1f} s: ratio {m96 / m48:.2f} "
          f"(paired {', '.join(f'{r:.2f}' for r in ratios)}); CPU seconds {statistics.median(cpu[48]):.1f} vs "
          f"{statistics.median(cpu[96]):.1f}: ratio {statistics.median(cpu[96]) / statistics.median(cpu[48]):.2f}")


if __name__ == "__main__":
    main()
