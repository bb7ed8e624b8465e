"""Benchmark (issue 2): autopar DATA mode vs torch DDP, and planning a 1.5B GPT.

Part 1, step time. The same GPT (examples.models) and the same global batch on 4 gloo ranks
(one thread each), in ONE spawned process group; per round each contender runs one training
step (forward, backward, AdamW step, zero_grad), interleaved A, B, A', B':

  autopar      autopar.parallelize(model, Mesh(4), mode="data"); pmodel.step(x, target=y)
  ddp          DistributedDataParallel(model) on the local batch, local mean loss
  autopar-bf16 the same with set_auto_parallel_context(grad_compression="bf16")
  ddp-bf16     DDP with torch's bf16_compress_hook
  autopar-acc  gradient accumulation over K micro-batches: K-1 pmodel.step in pmodel.no_sync(),
               the last outside (the gradients are summed once), then AdamW (--accumulate K)
  ddp-acc      DDP's own idiom on the same micro-batches: K-1 backward in ddp.no_sync()

Prints medians, the ratio of medians (target autopar/ddp <= 1.05) and the spread.

Part 2, planning: autopar.plan of a GPT-2-XL-sized GPT (1.5B parameters) on the meta device
for Mesh(8, device="a100-80gb"), mode "data" and "auto", each in a fresh subprocess:
wall time (target < 30 s), plan.solve_time, peak RSS (ru_maxrss, target < 2 GB).

    .venv/bin/python bench/data_parallel.py [--quick] [--reps N] [--skip-plan] [--skip-step]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Ratio, check, header, interleaved, run_fresh, training_step  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

CFG = {"vocab": 1024, "hidden": 256, "heads": 8, "layers": 4, "seq": 128, "batch": 16}
QUICK_CFG = {"vocab": 1024, "hidden": 256, "heads": 8, "layers": 2, "seq": 128, "batch": 8}


def _batch(cfg):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    y = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    return x, y


def _model(cfg):
    from examples.models import GPT

    torch.manual_seed(0)
    return GPT(vocab=cfg["vocab"], hidden=cfg["hidden"], heads=cfg["heads"], layers=cfg["layers"], seq=cfg["seq"])


def rank_step_times(rank: int, cfg: dict, reps: int, warmup: int, compression: bool, accumulate: int = 0) -> dict:
    """Runs on every rank of a 4-rank gloo group; returns per-contender step times."""
    import autopar
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from examples.models import lm_loss

    world = dist.get_world_size()
    x, y = _batch(cfg)
    per = cfg["batch"] // world
    xl, yl = x[rank * per:(rank + 1) * per].contiguous(), y[rank * per:(rank + 1) * per].contiguous()

    def autopar_step_fn(grad_compression):
        autopar.reset_auto_parallel_context()
        autopar.set_auto_parallel_context(grad_compression=grad_compression)
        pmodel = autopar.parallelize(_model(cfg), autopar.Mesh(world), example_inputs=(x,), loss_fn=lm_loss,
                                     example_target=y, mode="data")
        autopar.reset_auto_parallel_context()
        step, losses = training_step(pmodel, x, y)

        return step, losses, pmodel

    def ddp_step_fn(hook):
        ddp = DDP(_model(cfg))
        if hook is not None:
            # DDP refuses bf16_compress_hook by name off CUDA/NCCL ("requires CUDA 11+ and NCCL
            # 2.10+"), although gloo all-reduces bf16 fine: call the very same hook through a
            # wrapper so the name check does not see it.
            ddp.register_comm_hook(None, lambda state, bucket: hook(state, bucket))
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        losses = []

        def step():
            loss = lm_loss(ddp(xl), yl)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))

        return step, losses, ddp

    def autopar_acc_fn(k):
        xs, ys = x.chunk(k), y.chunk(k)
        pmodel = autopar.parallelize(_model(cfg), autopar.Mesh(world), example_inputs=(xs[0],), loss_fn=lm_loss,
                                     example_target=ys[0], mode="data")
        opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
        losses = []

        def step():
            with pmodel.no_sync():
                for i in range(k - 1):
                    pmodel.step(xs[i], target=ys[i])
            losses.append(float(pmodel.step(xs[-1], target=ys[-1])))
            opt.step()
            opt.zero_grad()

        return step, losses

    def ddp_acc_fn(k):
        ddp = DDP(_model(cfg))
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        xs, ys = xl.chunk(k), yl.chunk(k)
        losses = []

        def step():
            with ddp.no_sync():
                for i in range(k - 1):
                    (lm_loss(ddp(xs[i]), ys[i]) / k).backward()
            loss = lm_loss(ddp(xs[-1]), ys[-1]) / k
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))

        return step, losses

    fns, losses = {}, {}
    if accumulate:
        fns["autopar-acc"], losses["autopar-acc"] = autopar_acc_fn(accumulate)
        fns["ddp-acc"], losses["ddp-acc"] = ddp_acc_fn(accumulate)
    fns["autopar"], losses["autopar"], pmodel = autopar_step_fn(None)
    fns["ddp"], losses["ddp"], _ = ddp_step_fn(None)
    if compression:
        fns["autopar-bf16"], losses["autopar-bf16"], _ = autopar_step_fn("bf16")
        fns["ddp-bf16"], losses["ddp-bf16"], _ = ddp_step_fn(bf16_compress_hook)
    times = interleaved(fns, reps=reps, warmup=warmup)
    # first-step losses: autopar's is the global mean; DDP's the local mean -> average them
    first = {}
    for k, v in losses.items():
        if k.endswith("-acc"):
            continue
        t = torch.tensor([v[0]], dtype=torch.float64)
        if k.startswith("ddp"):
            dist.all_reduce(t)
            t /= world
        first[k] = float(t)
    return {"times": times, "first_loss": first, "uses_ddp": pmodel._ddp is not None,
            "plan_degrees": pmodel.plan.degrees, "params": sum(p.numel() for p in pmodel.parameters())}


def step_benchmark(cfg: dict, reps: int, warmup: int, compression: bool = True, nprocs: int = 4,
                   accumulate: int = 0) -> dict:
    from autopar.runtime.launch import RankPool

    pool = RankPool(nprocs, timeout_s=600)
    try:
        res = pool.run(rank_step_times, cfg, reps, warmup, compression, accumulate, timeout_s=900)[0]
    finally:
        pool.close()
    t = res["times"]
    out = {"cfg": cfg, "nprocs": nprocs, "reps": reps, "first_loss": res["first_loss"], "uses_ddp": res["uses_ddp"],
           "degrees": res["plan_degrees"], "params": res["params"],
           "plain": Ratio("autopar", "ddp", t["autopar"], t["ddp"])}
    if compression:
        out["bf16"] = Ratio("autopar-bf16", "ddp-bf16", t["autopar-bf16"], t["ddp-bf16"])
    if accumulate:
        out["acc"] = Ratio("autopar-acc", "ddp-acc", t["autopar-acc"], t["ddp-acc"])
    return out


# ---- planning a 1.5B GPT on the meta device (run in a fresh subprocess) --------------------

XL = {"vocab": 50257, "hidden": 1600, "heads": 25, "layers": 48, "seq": 1024, "batch": 8}


def plan_gpt(mode: str, devices: int = 8, axis_names=None, cfg: dict | None = None) -> dict:
    """Plan a GPT on the meta device; returns timings and the plan's headline numbers."""
    import math
    import time
    from collections import Counter

    import autopar
    from examples.models import GPT, lm_loss

    cfg = cfg or XL
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = GPT(vocab=cfg["vocab"], hidden=cfg["hidden"], heads=cfg["heads"], layers=cfg["layers"],
                    seq=cfg["seq"])
    x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]))
    y = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]))
    mesh = autopar.Mesh(devices, axis_names=tuple(axis_names) if axis_names else None, device="a100-80gb")
    t1, c1 = time.perf_counter(), time.process_time()
    plan = autopar.plan(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, mode=mode)
    t2, c2 = time.perf_counter(), time.process_time()
    nparams = sum(p.numel() for p in model.parameters())
    numel = {n: math.prod(d.shape) for n, d in plan.params.items() if d.kind == "parameter"}
    sharded = sum(v for n, v in numel.items() if "S(" in plan.params[n].spec)
    return {"mode": mode, "params": nparams, "build_s": t1 - t0, "plan_s": t2 - t1, "plan_cpu_s": c2 - c1,
            "solve_time": plan.solve_time,
            "degrees": plan.degrees, "step_time": plan.step_time, "mesh": list(plan.mesh.shape),
            "mem_gb": max(plan.memory_per_device) / 2**30, "status": plan.solver_status,
            "sharded_param_fraction": sharded / max(sum(numel.values()), 1),
            "collectives": dict(Counter(c.kind for c in plan.collectives(0))),
            "alternatives": [[a.degrees, a.step_time, a.note] for a in plan.alternatives]}


def plan_benchmark(modes=("data", "auto")) -> list[dict]:
    return [run_fresh("data_parallel", "plan_gpt", {"mode": m}) for m in modes]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller model, fewer rounds (~1-2 min)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--skip-plan", action="store_true")
    ap.add_argument("--skip-step", action="store_true")
    ap.add_argument("--accumulate", type=int, default=0, help="also time accumulation over K micro-batches with "
                    "no_sync (autopar vs DDP)")
    ap.add_argument("--no-compression", action="store_true", help="skip the bf16 contenders")
    ap.add_argument("--profile", default=None, help="calibration profile for the 'cpu' device (sets AUTOPAR_PROFILE "
                    "for this process and its ranks; default: whatever AUTOPAR_PROFILE / the machine's profile says)")
    ap.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    args = ap.parse_args(argv)
    if args.profile:
        os.environ["AUTOPAR_PROFILE"] = os.path.abspath(args.profile)
    cfg = QUICK_CFG if args.quick else CFG
    reps = args.reps or (6 if args.quick else 20)
    print(header("data parallel: autopar DATA vs torch DDP"))
    record = {}
    if not args.skip_step:
        r = step_benchmark(cfg, reps, warmup=2 if args.quick else 3, compression=not args.no_compression,
                           accumulate=args.accumulate)
        print(f"\n## step time, 4 gloo ranks x 1 thread, GPT {cfg} ({r['params'] / 1e6:.2f} M params), "
              f"AdamW, {reps} interleaved rounds")
        print(f"autopar plan degrees {r['degrees']}, gradient sync through DDP reducer: {r['uses_ddp']}")
        print("first-step global mean loss: " + ", ".join(f"{k} {v:.6f}" for k, v in r["first_loss"].items()))
        print(r["plain"].line())
        print(check("autopar/ddp step-time ratio", r["plain"].ratio, 1.05))
        if "bf16" in r:
            print(r["bf16"].line())
            print(check("autopar-bf16/ddp-bf16 step-time ratio", r["bf16"].ratio, 1.05))
        if "acc" in r:
            print(f"accumulation over {args.accumulate} micro-batches (no_sync on all but the last), per optimizer step:")
            print(r["acc"].line())
            print(check("autopar-acc/ddp-acc step-time ratio", r["acc"].ratio, 1.05))
        record["step"] = {"cfg": cfg, "first_loss": r["first_loss"],
                          **{k: r[k].to_dict() for k in ("plain", "bf16", "acc") if k in r}}
    if not args.skip_plan:
        print(f"\n## planning GPT {XL} on the meta device, Mesh(8, device='a100-80gb'), fresh process each")
        rows = plan_benchmark()
        for row in rows:
            print(f"mode {row['mode']:<5} params {row['params'] / 1e9:.3f} B  plan() wall {row['plan_s']:.1f} s "
                  f"(CPU {row['plan_cpu_s']:.1f} s, solve_time {row['solve_time']:.1f} s, model build {row['build_s']:.1f} s)  "
                  f"peak RSS {row['peak_rss_mib']:.0f} MiB  -> degrees {row['degrees']} mesh {row['mesh']} "
                  f"predicted step {row['step_time']:.3f} s, {row['mem_gb']:.1f} GiB/device")
            print("  " + check(f"{row['mode']} plan wall s", row["plan_s"], 30.0) + "   "
                  + check("peak RSS GiB", row["peak_rss_mib"] / 1024, 2.0))
        record["plan"] = rows
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
