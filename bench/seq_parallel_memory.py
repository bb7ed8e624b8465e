"""Predicted activation memory of a tensor-parallel GPT with and without sequence parallelism
(Megatron-SP: the norms split along the sequence on the tp axis), planning only.

    PYTHONPATH=. python bench/seq_parallel_memory.py [--tp 4] [--hidden 1024] [--layers 4] [--seq 1024]
"""
from __future__ import annotations

import argparse
import time

import torch

import autopar
from autopar import Mesh, Shard
from autopar.report.sequence_parallel import sequence_parallel
from examples.models import GPT, lm_loss


def plan(sp: bool, a) -> autopar.Plan:
    autopar.clear_annotations()
    autopar.reset_auto_parallel_context()
    autopar.set_auto_parallel_context(recompute="none", accumulation=1, zero=0)
    autopar.shard("blocks.*.qkv", weight={"tp": Shard(0, 3)})
    autopar.shard("blocks.*.fc1", weight={"tp": Shard(0)}, bias={"tp": Shard(0)})
    autopar.shard("blocks.*.proj", weight={"tp": Shard(1)})
    autopar.shard("blocks.*.fc2", weight={"tp": Shard(1)})
    autopar.op_strategy("blocks.*.ln*", tp="S1" if sp else "replicate")
    with torch.device("meta"):
        model = GPT(vocab=a.vocab, hidden=a.hidden, heads=16, layers=a.layers, seq=a.seq, dropout=0.1, qkv_bias=False)
    x = torch.randint(0, a.vocab, (a.batch, a.seq))
    try:
        return autopar.plan(model, Mesh(a.tp, axis_names=("tp",), device=a.device), example_inputs=(x,),
                            loss_fn=lm_loss, example_target=x, mode="semi_auto")
    finally:
        autopar.clear_annotations()
        autopar.reset_auto_parallel_context()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for k, v in (("tp", 4), ("hidden", 1024), ("layers", 4), ("seq", 1024), ("batch", 8), ("vocab", 2048)):
        p.add_argument(f"--{k}", type=int, default=v)
    p.add_argument("--device", default="a100-80gb")
    a = p.parse_args()
    for sp in (False, True):
        t = time.perf_counter()
        pl = plan(sp, a)
        b = pl.memory_breakdown
        print(f"sp={'on ' if sp else 'off'}  activations {b['activations'] / 2**20:8.1f} MiB   peak "
              f"{max(pl.memory_per_device) / 2**20:8.1f} MiB   step {pl.step_time * 1e3:7.2f} ms   "
              f"sp norms {sequence_parallel(pl).get('tp', [])}   plan {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
