"""Benchmark (issue 15 part 1): sharded checkpoint save, synchronous vs async (dcp.async_save).

A GPT (examples.models) under a DATA plan (optionally ZeRO-forced) on N gloo CPU ranks, AdamW
state present. Per round, interleaved in a shuffled order (bench/common.interleaved):

  sync              pmodel.save(path, optimizer=opt): the caller is blocked until the checkpoint is in place
  async-return      pmodel.save(path, optimizer=opt, async_=True): time until it returns (the state is
                    copied; the write and the rename go on in the background); ``async`` is the time
                    until its future completes
  sync+step         a synchronous save, then one training step
  async+step        an async save, one training step while it writes, then its future waited for
  gather            the previous implementation, for reference: the full model gathered and written
                    by rank 0 (torch.save), each rank's optimizer state in a file of its own

Prints medians and paired ratios (the project's timing rule: never compare single absolute times).

    .venv/bin/python bench/checkpoint.py [--nprocs 2] [--reps 8] [--zero 0] [--quick]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Ratio, gpt_of, header, interleaved  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

CFG = {"vocab": 1024, "hidden": 256, "heads": 8, "layers": 4, "seq": 128, "batch": 16}
QUICK_CFG = {"vocab": 1024, "hidden": 128, "heads": 4, "layers": 2, "seq": 64, "batch": 8}


def _gather_save(pm, opt, path: str) -> None:
    """What runtime/checkpoint.py did before DCP: rank 0 writes the gathered model, each rank its optimizer."""
    state = pm.full_state_dict()
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        torch.save({"model": state}, f"{path}/model.pt")
    dist.barrier()
    torch.save(opt.state_dict(), f"{path}/optim.rank{dist.get_rank()}.pt")
    dist.barrier()


def rank_run(rank: int, cfg: dict, reps: int, warmup: int, zero: int, root: str) -> dict:
    import autopar
    from examples.models import lm_loss

    torch.set_num_threads(1)
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    y = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    plan = autopar.plan(gpt_of(cfg), autopar.Mesh(world), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                        mode="data")
    plan = dataclasses.replace(plan, memory_options=dataclasses.replace(plan.memory_options, zero=zero))
    pm = autopar.parallelize(gpt_of(cfg), autopar.Mesh(world), example_inputs=(x,), loss_fn=lm_loss,
                             example_target=y, plan=plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)

    def train_step():
        pm.step(x, target=y)
        opt.step()
        opt.zero_grad()

    def train_step_after(fut):
        train_step()
        fut.result()

    returns = []

    def async_save():
        t0 = time.perf_counter()
        fut = pm.save(f"{root}/async", optimizer=opt, async_=True)
        returns.append(time.perf_counter() - t0)
        fut.result()

    train_step()
    fns = {
        "sync": lambda: pm.save(f"{root}/sync", optimizer=opt),
        "async": async_save,
        "sync+step": lambda: (pm.save(f"{root}/sync_step", optimizer=opt), train_step()),
        "async+step": lambda: train_step_after(pm.save(f"{root}/async_step", optimizer=opt, async_=True)),
        "gather": lambda: _gather_save(pm, opt, f"{root}/gather"),
        "step": train_step,
    }
    times = interleaved(fns, reps=reps, warmup=warmup, shuffle=True)
    ret = torch.tensor(returns[warmup:], dtype=torch.float64)
    dist.all_reduce(ret, op=dist.ReduceOp.MAX)
    sizes = {k: sum(f.stat().st_size for f in Path(f"{root}/{k}").iterdir()) for k in ("sync", "gather")}
    return {"times": times, "async_return": ret.tolist(), "sizes": sizes,
            "params": sum(p.numel() for p in gpt_of(cfg).parameters())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--zero", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    from autopar.runtime.launch import RankPool

    cfg = QUICK_CFG if args.quick else CFG
    root = tempfile.mkdtemp(prefix="autopar-ckpt-bench-")
    pool = RankPool(args.nprocs, timeout_s=900)
    try:
        res = pool.run(rank_run, cfg, args.reps, args.warmup, args.zero, root, timeout_s=1800)[0]
    finally:
        pool.close()
        shutil.rmtree(root, ignore_errors=True)
    t = res["times"]
    t["async-return"] = res["async_return"]
    mb = {k: v / 2 ** 20 for k, v in res["sizes"].items()}
    print(header(f"checkpoint save: GPT {cfg}, {res['params']} parameters + AdamW state, DATA plan zero={args.zero}, "
                 f"{args.nprocs} gloo CPU ranks, {args.reps} interleaved rounds; on disk: DCP {mb['sync']:.1f} MB, "
                 f"gather {mb['gather']:.1f} MB"))
    for a, b in (("async-return", "sync"), ("async", "sync"), ("async+step", "sync+step"), ("sync", "gather"),
                 ("step", "sync")):
        print(Ratio(a, b, t[a], t[b]).line())


if __name__ == "__main__":
    main()
