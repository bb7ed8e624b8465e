"""Benchmark (issue 13): a model that does not fit, planned by AUTO, against torch's expert recipe.

A GPT (examples.models) on N gloo CPU ranks whose per-device cap (``Mesh(memory_gb=cap)``) is
the replicated training state (parameters, gradients, AdamW moments: 16 B/param) divided by
``--state-over-cap`` (or ``--cap-fraction`` of what DDP needs per rank, state plus activations):
DDP does not fit. At 4 ranks the state alone is 4x the cap when split four ways, so ~2.7x is about
the most any 4-rank plan fits by the count of state and saved tensors; by the live peak (every
storage, FSDP2's per-layer all-gather and reduce-scatter buffers included) torch's recipe needs
~42 MiB on this job, so ``--state-over-cap 1.2`` is the tightest cap at which it fits. Contenders, in ONE spawned process group,
interleaved with a shuffled order per round, one training step each (forward, backward, AdamW,
zero_grad):

  autopar-auto    autopar.parallelize(mode="auto") under the cap: AUTO picks layout and memory
                  options (ZeRO stage, recomputation, accumulation) itself, as shipped (its best
                  predicted plans timed on the ranks; ``--no-autotune``: the predicted best alone)
  fsdp2-ckpt      torch's recipe for the same job (torchtitan's): every block wrapped in
                  torch.utils.checkpoint (non-reentrant), fully_shard on every block and the root
                  (reshard_after_forward=True: ZeRO-3)
  fsdp2-ckpt-acc2 the same model run as 2 microbatches of half the rows, gradients reduce-scattered
                  into the sharded gradients after each (what a person does when the first OOMs:
                  FSDP2 without ``set_requires_gradient_sync(False)``, which would keep whole gradients)
  ddp             DistributedDataParallel: the baseline step time (over the cap)

Memory per rank, counted exactly in one measured step (``memory_measure.SavedTensorMeter``):
parameters, gradients and optimizer state this rank holds after backward, and the peak of the
storages autograd saves (FSDP2's gathered weights saved for backward count there). And the live
peak (``memory_measure.live_peak``, a dispatch mode): every storage alive at the worst moment of
the step, gathered weights, backward temporaries and the optimizer's temporaries included: what a
device's allocator must hold, and what "fits the cap" is judged by. The torch baseline of the ratio
is the fastest torch contender whose live peak fits ("person's best"); both FSDP2 forms are printed.

    .venv/bin/python bench/memory_fit.py [--nprocs 4] [--reps 8] [--state-over-cap 2.7 | --cap-fraction 0.3]
                                         [--cfg default|deep|quick] [--no-autotune]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Ratio, header, interleaved  # noqa: E402
from memory_measure import SavedTensorMeter, _key, live_peak, unique_bytes  # noqa: E402
from recompute import Checkpointed  # noqa: E402  (torch.utils.checkpoint around one block)
from common import gpt_of as _model  # noqa: E402  (the seeded example GPT of a config)
from zero import CFG, rank_batch  # noqa: E402  (the job of bench/zero.py, RESULTS §7)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

QUICK_CFG = {"vocab": 512, "hidden": 128, "heads": 4, "layers": 2, "seq": 64, "batch": 8}
# deep and thin: 24 layers of hidden 128, a small vocabulary and short rows, so that one layer's
# transients (its gathered weights, its gradients, its recomputed activations) and the logits are a
# small part of the state: the shape on which a plan can come near the 4x of 4 ranks sharding it all
DEEP_CFG = {"vocab": 256, "hidden": 128, "heads": 4, "layers": 24, "seq": 32, "batch": 8}
CFGS = {"default": CFG, "quick": QUICK_CFG, "deep": DEEP_CFG}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _held(params: list, opt, meter: SavedTensorMeter) -> dict:
    state = [_local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params": unique_bytes(_local(p) for p in params),
            "grads": unique_bytes(_local(p.grad) for p in params if p.grad is not None),
            "optimizer": unique_bytes(state), "activations": meter.peak}


def ddp_need(cfg, world: int) -> float:
    """Bytes per rank a DDP plan of the job needs (autopar's prediction, no cap)."""
    import autopar
    from examples.models import lm_loss

    x = torch.zeros(cfg["batch"], cfg["seq"], dtype=torch.long)
    plan = autopar.plan(_model(cfg), autopar.Mesh(world), example_inputs=(x,), loss_fn=lm_loss, example_target=x,
                        mode="data")
    return max(plan.memory_per_device)


def rank_run(rank: int, cfg: dict, reps: int, warmup: int, cap_gb: float, autotune: bool = True,
             plan_path: str | None = None) -> dict:
    import autopar
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from examples.models import lm_loss

    world = dist.get_world_size()
    x, y, xl, yl = rank_batch(cfg, rank, world)
    fns = {}

    def torch_step(module, opt, parts: int = 1):
        def step(count: bool = True):
            params = list(module.parameters())
            meter = SavedTensorMeter()
            meter.exclude |= {_key(_local(p))[0] for p in params}
            with meter.hooks() if count else contextlib.nullcontext():
                for xs, ys in zip(xl.chunk(parts), yl.chunk(parts)):
                    (lm_loss(module(xs), ys) / parts).backward()
            held = _held(params, opt, meter)
            opt.step()
            opt.zero_grad()
            return held
        return step

    def add(name, module, parts: int = 1):
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
        fns[name] = torch_step(module, opt, parts)
        held_by[name] = (module, opt)

    held_by = {}                    # contender -> (module, optimizer): what exists before a step
    add("ddp", DDP(_model(cfg)))

    mesh = init_device_mesh("cpu", (world,))

    def fsdp2_ckpt():
        m = _model(cfg)
        m.blocks = nn.ModuleList(Checkpointed(b) for b in m.blocks)
        for blk in m.blocks:
            fully_shard(blk, mesh=mesh, reshard_after_forward=True)
        return fully_shard(m, mesh=mesh, reshard_after_forward=True)
    add("fsdp2-ckpt", fsdp2_ckpt())
    add("fsdp2-ckpt-acc2", fsdp2_ckpt(), parts=2)

    if not autotune:
        autopar.set_auto_parallel_context(autotune_top_k=1)  # the predicted best alone, not AUTO's measured pick
    if plan_path:                   # AUTO's plan made beforehand (``--plan``), applied as is
        pm = autopar.parallelize(_model(cfg), autopar.Mesh(world, memory_gb=cap_gb), example_inputs=(x,),
                                 loss_fn=lm_loss, example_target=y, mode="hybrid", plan=autopar.Plan.load(plan_path))
    else:
        pm = autopar.parallelize(_model(cfg), autopar.Mesh(world, memory_gb=cap_gb), example_inputs=(x,),
                                 loss_fn=lm_loss, example_target=y, mode="auto")
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)

    def auto_step(count: bool = True):
        params = list(pm.parameters())
        meter = SavedTensorMeter()
        meter.exclude |= {_key(p)[0] for p in params}
        with meter.hooks() if count else contextlib.nullcontext():
            pm.step(x, target=y)
        held = _held(params, opt, meter)
        opt.step()
        opt.zero_grad()
        return held
    fns["autopar-auto"] = auto_step
    held_by["autopar-auto"] = (pm, opt)

    times = interleaved({k: (lambda f=f: f(count=False)) for k, f in fns.items()}, reps=reps, warmup=warmup, shuffle=True)
    held = {k: f() for k, f in fns.items()}
    peak = {k: torch.tensor([float(sum(v.values()))]) for k, v in held.items()}
    # the live peak of a plain step: the counting hooks above change what a checkpointed region keeps
    live = {k: torch.tensor([float(live_peak(lambda f=f: f(count=False), *held_by[k], x, y))]) for k, f in fns.items()}
    for t in [*peak.values(), *live.values()]:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"times": times, "held": held, "peak": {k: float(t) for k, t in peak.items()},
            "live": {k: float(t) for k, t in live.items()},
            "plan": pm.plan.memory_options.summary(), "degrees": pm.plan.degrees,
            "predicted": max(pm.plan.memory_per_device), "breakdown": pm.plan.memory_breakdown}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--cap-fraction", type=float, default=None)
    ap.add_argument("--state-over-cap", type=float, default=2.7)
    ap.add_argument("--cfg", choices=sorted(CFGS), default="default",
                    help="the GPT: default (bench/zero.py's, 4 layers of 256), deep (24 layers of 128), quick (2 of 128)")
    ap.add_argument("--quick", action="store_true", help="--cfg quick")
    ap.add_argument("--no-autotune", action="store_true", help="AUTO's predicted best alone (autotune_top_k=1)")
    ap.add_argument("--plan", default=None,
                    help="a plan JSON AUTO made for this job and cap (autopar.plan(..., mode='auto').save): applied as "
                         "is, so the ranks do not each plan (AUTO's predicted best alone)")
    args = ap.parse_args()
    from autopar.runtime.launch import RankPool

    cfg = CFGS["quick" if args.quick else args.cfg]
    need = ddp_need(cfg, args.nprocs)
    state = 16 * sum(p.numel() for p in _model(cfg).parameters())
    cap = args.cap_fraction * need if args.cap_fraction else state / args.state_over_cap
    pool = RankPool(args.nprocs, timeout_s=900)
    try:
        res = pool.run(rank_run, cfg, args.reps, args.warmup, cap / 2**30, not args.no_autotune, args.plan,
                       timeout_s=3600)[0]
    finally:
        pool.close()
    print(header(f"Fitting under a cap: GPT {cfg} on {args.nprocs} gloo CPU ranks, cap {cap / 2**20:.3f} MiB: the "
                 f"replicated training state {state / 2**20:.1f} MiB is {state / cap:.2f}x the cap, DDP's predicted need "
                 f"{need / 2**20:.1f} MiB per rank; {args.reps} rounds"))
    how = "plan file, predicted best" if args.plan else "autotuned" if not args.no_autotune else "predicted best"
    print(f"AUTO chose ({how}): {res['degrees']}, {res['plan']}; predicted peak {res['predicted'] / 2**20:.3f} MiB "
          f"({ {k: round(v / 2**20, 2) for k, v in res['breakdown'].items()} } MiB)")
    t, live = res["times"], res["live"]
    fitting = [k for k in ("fsdp2-ckpt", "fsdp2-ckpt-acc2") if live[k] <= cap]
    best = min(fitting, key=lambda k: Ratio(k, k, t[k], t[k]).median_a) if fitting else None
    print(f"person's best torch plan whose live peak fits the cap: {best or 'none (both FSDP2 forms are over it)'}")
    if best:
        print(Ratio("autopar-auto", best, t["autopar-auto"], t[best]).line())
    for base in ("fsdp2-ckpt", "fsdp2-ckpt-acc2", "ddp"):
        if base != best:
            print(Ratio("autopar-auto", base, t["autopar-auto"], t[base]).line())
    print()
    print(f"{'contender':16s} {'step ms':>8s} {'params':>8s} {'grads':>8s} {'optim':>8s} {'saved':>8s} "
          f"{'counted':>8s} {'live peak':>9s} {'fits cap':>8s}   (MiB; max over ranks but the held columns: rank 0)")
    for name in t:
        h = {k: v / 2**20 for k, v in res["held"][name].items()}
        med = Ratio(name, name, t[name], t[name]).median_a
        print(f"{name:16s} {med * 1e3:8.1f} {h['params']:8.2f} {h['grads']:8.2f} {h['optimizer']:8.2f} "
              f"{h['activations']:8.2f} {res['peak'][name] / 2**20:8.2f} {live[name] / 2**20:9.3f} "
              f"{'yes' if live[name] <= cap else 'no':>8s}")

if __name__ == "__main__":
    main()
