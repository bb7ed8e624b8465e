"""Benchmark (issue 13 part 3): autopar ZeRO-1/2/3 vs torch FSDP2 ``fully_shard`` and DDP.

The same GPT (examples.models, tied embeddings) and the same global batch on N gloo CPU ranks
(one thread each) in ONE spawned process group; per round each contender runs one training step
(forward, backward, AdamW step, zero_grad), interleaved with a shuffled order per round:

  ddp              DistributedDataParallel(model), local batch, local mean loss
  autopar-z0       autopar DATA plan (DDP's reducer inside)
  autopar-z1/z2/z3 the same plan forced to memory_options.zero = 1 / 2 / 3 (runtime/zero.py)
  fsdp2-reshard    fully_shard on every block and the root, reshard_after_forward=True (ZeRO-3)
  fsdp2-keep       the same with reshard_after_forward=False (ZeRO-2-like: parameters kept
                   gathered from forward to backward)

Prints each contender's median step time, its ratio to DDP's (paired spread) and per-rank memory:
bytes of parameters + gradients + AdamW state this rank holds after backward (gradients
present, before the optimizer step; FSDP2's parameters counted as their local shards).

    .venv/bin/python bench/zero.py [--nprocs 2] [--reps 10] [--quick]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Ratio, gpt_of, header, interleaved  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

CFG = {"vocab": 1024, "hidden": 256, "heads": 8, "layers": 4, "seq": 128, "batch": 16}
QUICK_CFG = {"vocab": 1024, "hidden": 256, "heads": 8, "layers": 2, "seq": 64, "batch": 8}


def rank_batch(cfg, rank: int, world: int):
    """(global tokens, targets, this rank's rows of each): the batch every contender trains on."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    y = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    per = cfg["batch"] // world
    return x, y, x[rank * per:(rank + 1) * per].contiguous(), y[rank * per:(rank + 1) * per].contiguous()


def _nbytes(t) -> int:
    if t is None:
        return 0
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def _held(params, opt, extra_param_bytes: int = 0) -> dict:
    params = list(params)
    state = sum(_nbytes(v) for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"params": sum(_nbytes(p) for p in params) + extra_param_bytes,
            "grads": sum(_nbytes(p.grad) for p in params), "optimizer": state}


def rank_run(rank: int, cfg: dict, reps: int, warmup: int) -> dict:
    import autopar
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from examples.models import lm_loss

    world = dist.get_world_size()
    x, y, xl, yl = rank_batch(cfg, rank, world)
    fns, memory, losses = {}, {}, {}

    def add(name, step, memory_fn):
        out = []

        def run():
            out.append(step())
        fns[name], losses[name] = run, out
        memory[name] = memory_fn

    # DDP
    ddp = DDP(gpt_of(cfg))
    opt_ddp = torch.optim.AdamW(ddp.parameters(), lr=1e-3)

    def make_torch_step(module, opt):
        def step(measure=False):
            loss = lm_loss(module(xl), yl)
            loss.backward()
            held = _held(module.parameters(), opt) if measure else None
            opt.step()
            opt.zero_grad()
            return held if measure else float(loss.detach())
        return step

    s = make_torch_step(ddp, opt_ddp)
    add("ddp", s, lambda s=s: s(True))

    # autopar: one DATA plan, forced to each ZeRO stage
    base = autopar.plan(gpt_of(cfg), autopar.Mesh(world), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                        mode="data")
    for zero in (0, 1, 2, 3):
        plan = dataclasses.replace(base, memory_options=dataclasses.replace(base.memory_options, zero=zero))
        pm = autopar.parallelize(gpt_of(cfg), autopar.Mesh(world), example_inputs=(x,), loss_fn=lm_loss,
                                 example_target=y, plan=plan)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)

        def step(measure=False, pm=pm, opt=opt):
            loss = pm.step(x, target=y)
            held = None
            if measure:
                if pm._zero is not None:
                    b = pm._zero.held_bytes()
                    held = {**_held([], opt), "params": b["params"], "grads": b["grads"]}
                else:
                    held = _held(pm.program.parameters(), opt)
            opt.step()
            opt.zero_grad()
            return held if measure else float(loss)
        add(f"autopar-z{zero}", step, lambda s=step: s(True))

    # FSDP2
    mesh = init_device_mesh("cpu", (world,))
    for name, reshard in (("fsdp2-reshard", True), ("fsdp2-keep", False)):
        m = gpt_of(cfg)
        for blk in m.blocks:
            fully_shard(blk, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(m, mesh=mesh, reshard_after_forward=reshard)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        s = make_torch_step(m, opt)
        add(name, s, lambda s=s: s(True))

    times = interleaved(fns, reps=reps, warmup=warmup, shuffle=True)
    held = {k: f() for k, f in memory.items()}
    # first-step losses: global means (the torch contenders' local means averaged over ranks)
    first = {}
    for k, v in losses.items():
        t = torch.tensor([v[0]], dtype=torch.float64)
        if not k.startswith("autopar"):
            dist.all_reduce(t)
            t /= world
        first[k] = float(t)
    return {"times": times, "held": held, "first_loss": first,
            "params": sum(p.numel() for p in gpt_of(cfg).parameters())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    from autopar.runtime.launch import RankPool

    cfg = QUICK_CFG if args.quick else CFG
    pool = RankPool(args.nprocs, timeout_s=900)
    try:
        res = pool.run(rank_run, cfg, args.reps, args.warmup, timeout_s=1800)[0]
    finally:
        pool.close()
    print(header(f"ZeRO step time and memory: GPT {cfg}, {res['params']} parameters, {args.nprocs} gloo CPU ranks, "
                 f"{args.reps} interleaved rounds"))
    t = res["times"]
    for name in t:
        if name != "ddp":
            print(Ratio(name, "ddp", t[name], t["ddp"]).line())
    print()
    print(f"{'contender':16s} {'step ms':>8s} {'/ddp':>6s} {'params MB':>10s} {'grads MB':>9s} {'optim MB':>9s} "
          f"{'total MB':>9s} {'first loss':>11s}")
    ddp_med = Ratio("ddp", "ddp", t["ddp"], t["ddp"]).median_a
    for name in t:
        h = res["held"][name]
        med = Ratio(name, "ddp", t[name], t["ddp"]).median_a
        mb = {k: v / 2 ** 20 for k, v in h.items()}
        print(f"{name:16s} {med * 1e3:8.1f} {med / ddp_med:6.2f} {mb['params']:10.2f} {mb['grads']:9.2f} "
              f"{mb['optimizer']:9.2f} {sum(mb.values()):9.2f} {res['first_loss'][name]:11.5f}")


if __name__ == "__main__":
    main()
