"""Benchmark (issue 37): GPT-1.3B on 4 x v100-16gb with Alpa's job (seq 1024, batch 1024), planned
in fp32, mixed_precision="fp16" (costed at the V100's 125 TFLOP/s fp16 tensor-core peak) and "bf16"
(no bf16 tensor cores on a V100: costed at the fp32 rate), on the meta device. Prints each plan's
predicted step time, layout and peak memory.

    PYTHONPATH=. .venv/bin/python bench/fp16_v100.py [--precisions fp32,fp16,bf16] [--time-budget S]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from examples import factories  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precisions", default="fp32,fp16,bf16")
    ap.add_argument("--time-budget", type=float, default=None)
    args = ap.parse_args()
    for name in args.precisions.split(","):
        model, inputs, loss, target = factories.gpt_1_3b(batch=1024, seq=1024)
        t0 = time.perf_counter()
        p = autopar.plan(model, autopar.Mesh(4, device="v100-16gb"), example_inputs=inputs, loss_fn=loss,
                         example_target=target, mode="auto", mixed_precision=None if name == "fp32" else name,
                         time_budget=args.time_budget)
        d = p.degrees
        print(f"GPT-1.3B seq 1024 batch 1024 on 4 x v100-16gb, {name}: step {p.step_time:.1f} s | "
              f"dp={d['dp']} tp={d['tp']} pp={d['pp']} microbatches={p.microbatches} {p.schedule} | "
              f"{p.memory_options.summary()} | peak {max(p.memory_per_device) / 2**30:.2f} GiB | "
              f"planned in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
