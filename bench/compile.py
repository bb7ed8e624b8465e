"""Benchmark (issue 16): eager vs compiled (``compile=True``) per-rank programs.

CPU (no CUDA device): the same GPT, global batch and plan, 1 rank (STAND_ALONE) and 4 gloo
ranks (DATA; and TP on a ("tp",) mesh), one thread per rank. Per round every contender runs one
training step (``step``, AdamW step, zero_grad), interleaved and shuffled (bench/common.py):

  autopar            parallelize(..., compile=False)
  autopar-compiled   parallelize(..., compile=True): the rank's graphs through torch.compile/inductor
  torch              the native equivalent: the model itself (1 rank) or DDP(model) (DATA)
  torch-compiled     torch.compile(model) (1 rank) or DDP(torch.compile(model)) (DATA)

and prints the medians, ratios (target compiled/eager <= 0.8 on a GPU), the first (compiling)
step's seconds, the graphs dynamo made and its graph breaks, and the largest relative difference
between the eager and compiled losses.

GPU (``torch.cuda.is_available()``): one GPU, a 1.3B GPT (hidden 2048, 24 layers, seq 1024) in
bf16 (``mixed_precision="bf16"``): autopar eager vs compiled vs torch.compile(model) under the
same policy, with MFU = plan.flops / step time / the device's bf16 peak (target >= 0.55).

    .venv/bin/python bench/compile.py [--quick] [--reps N] [--ranks 1 4] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Ratio, check, header, interleaved, training_step  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

CFG = {"vocab": 512, "hidden": 128, "heads": 4, "layers": 2, "seq": 64, "batch": 8}
QUICK_CFG = {"vocab": 256, "hidden": 64, "heads": 4, "layers": 2, "seq": 32, "batch": 8}
GPU_CFG = {"vocab": 50304, "hidden": 2048, "heads": 16, "layers": 24, "seq": 1024, "batch": 8}


def _batch(cfg, device="cpu"):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    y = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    return x.to(device), y.to(device)


def _model(cfg, device="cpu"):
    from examples.models import GPT

    torch.manual_seed(0)
    return GPT(vocab=cfg["vocab"], hidden=cfg["hidden"], heads=cfg["heads"], layers=cfg["layers"],
               seq=cfg["seq"]).to(device)


def _dynamo_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _collectives_in_graphs(pmodel) -> int:
    """How many functional collectives inductor got inside this rank's compiled graphs: counted in
    the code dynamo produced is not public, so count the collective calls in the per-rank graph(s)
    that a graph break would have left outside (0 breaks: all of them are inside)."""
    return pmodel.code.count("autopar_collectives_comm_")


def _autopar_step(cfg, mesh, mode, compiled, setup=None, device="cpu", **kw):
    """(step function, losses, first step seconds, dynamo graphs, graph breaks, plan)."""
    import autopar
    from examples.models import lm_loss

    autopar.reset_auto_parallel_context()
    autopar.clear_annotations()
    if setup is not None:
        setup()
    x, y = _batch(cfg, device)
    pmodel = autopar.parallelize(_model(cfg, device), mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                                 mode=mode, compile=compiled, **kw)
    step, losses = training_step(pmodel, x, y)

    graphs0, breaks0 = _dynamo_counts()
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    graphs, breaks = _dynamo_counts()
    step.collectives = _collectives_in_graphs(pmodel)
    return step, losses, first, graphs - graphs0, breaks - breaks0, pmodel.plan


def _torch_step(cfg, compiled, ddp, device="cpu", low=None):
    """The native equivalent: the model (or DDP over it) on this rank's part of the batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from examples.models import lm_loss

    x, y = _batch(cfg, device)
    if ddp:
        world, rank = dist.get_world_size(), dist.get_rank()
        per = cfg["batch"] // world
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    model = _model(cfg, device)
    run = torch.compile(model) if compiled else model
    if ddp:
        run = DDP(run)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        with torch.autocast(device, dtype=low, enabled=low is not None):
            loss = lm_loss(run(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    t0 = time.perf_counter()
    step()
    return step, time.perf_counter() - t0


def _tp_setup():
    import autopar
    from autopar import Shard

    autopar.shard("blocks.*.fc1", weight={"tp": Shard(0)})
    autopar.shard("blocks.*.fc2", weight={"tp": Shard(1)})


def rank_job(rank: int, cfg: dict, layout: str, reps: int, warmup: int) -> dict:
    """One layout ("one rank", "data", "tp") on every rank: eager and compiled, autopar and torch."""
    import autopar

    torch.set_num_threads(1)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if layout == "one rank":
        mesh, mode, setup = autopar.Mesh(1), "stand_alone", None
    elif layout == "data":
        mesh, mode, setup = autopar.Mesh(world), "data", None
    else:
        mesh, mode, setup = autopar.Mesh((world,), axis_names=("tp",)), "semi_auto", _tp_setup
    out = {"layout": layout, "ranks": world}
    fns = {}
    for compiled in (False, True):
        name = "autopar-compiled" if compiled else "autopar"
        step, losses, first, graphs, breaks, plan = _autopar_step(cfg, mesh, mode, compiled, setup)
        fns[name] = step
        out[name] = {"first_step_s": first, "graphs": graphs, "graph_breaks": breaks, "losses": losses,
                     "predicted_ms": plan.step_time * 1e3, "collective_calls": step.collectives}
    if layout != "tp":
        for compiled in (False, True):
            name = "torch-compiled" if compiled else "torch"
            fns[name], first = _torch_step(cfg, compiled, layout == "data")
            out[name] = {"first_step_s": first}
    times = interleaved(fns, reps, warmup, shuffle=True)
    out["times"] = times
    a, c = out["autopar"]["losses"], out["autopar-compiled"]["losses"]
    n = min(len(a), len(c))
    out["loss_rel_diff"] = max(abs(p - q) / max(abs(p), 1e-9) for p, q in zip(a[:n], c[:n]))
    for k in ("autopar", "autopar-compiled"):
        del out[k]["losses"]
    return out


def _report(out: dict) -> list[str]:
    t = out["times"]
    lines = [f"## {out['layout']} ({out['ranks']} rank{'s' if out['ranks'] > 1 else ''})"]
    for k in ("autopar", "autopar-compiled"):
        o = out[k]
        lines.append(f"  {k}: first step {o['first_step_s']:.1f} s, dynamo graphs {o['graphs']}, graph breaks "
                     f"{o['graph_breaks']}, collective calls in the rank's graph {o['collective_calls']}, "
                     f"predicted {o['predicted_ms']:.1f} ms")
    lines.append(Ratio("autopar-compiled", "autopar", t["autopar-compiled"], t["autopar"]).line())
    if "torch" in t:
        lines.append(Ratio("torch-compiled", "torch", t["torch-compiled"], t["torch"]).line())
        lines.append(Ratio("autopar-compiled", "torch-compiled", t["autopar-compiled"], t["torch-compiled"]).line())
    lines.append(f"  eager vs compiled losses: largest relative difference {out['loss_rel_diff']:.2e}")
    return lines


def cpu_main(args) -> list[dict]:
    from autopar.runtime.launch import RankPool

    cfg = QUICK_CFG if args.quick else CFG
    print(f"config {cfg}; CPU: no CUDA device, so the CPU variant (one thread per rank, gloo)")
    results = []
    for n in args.ranks:
        layouts = ["one rank"] if n == 1 else ["data", "tp"]
        if n == 1:
            outs = [rank_job(0, cfg, "one rank", args.reps, args.warmup)]
        else:
            pool = RankPool(n, timeout_s=1800)
            try:
                outs = [pool.run(rank_job, cfg, layout, args.reps, args.warmup)[0] for layout in layouts]
            finally:
                pool.close()
        for out in outs:
            print("\n".join(_report(out)), flush=True)
            results.append(out)
    return results


def gpu_main(args) -> list[dict]:
    """One GPU, a 1.3B GPT in bf16: autopar eager vs compiled vs torch.compile(model) under autocast."""
    import autopar
    from autopar.cost_models.devices import get_device

    cfg = dict(GPU_CFG, batch=args.gpu_batch)
    name = torch.cuda.get_device_name()
    preset = "h200" if "H200" in name else "h100" if "H100" in name else "a100-80gb"
    mesh = autopar.Mesh(1, device=preset)
    print(f"config {cfg}; GPU {name} (peak from the {preset!r} preset)")
    fns, out = {}, {"layout": "one GPU", "ranks": 1}
    for compiled in (False, True):
        key = "autopar-compiled" if compiled else "autopar"
        step, losses, first, graphs, breaks, plan = _autopar_step(cfg, mesh, "stand_alone", compiled, device="cuda",
                                                                  mixed_precision="bf16")
        fns[key] = step
        out[key] = {"first_step_s": first, "graphs": graphs, "graph_breaks": breaks,
                    "predicted_ms": plan.step_time * 1e3, "flops": plan.flops}
    if not args.skip_torch:
        fns["torch-compiled"], first = _torch_step(cfg, True, False, "cuda", torch.bfloat16)
        out["torch-compiled"] = {"first_step_s": first}

    def synced(fn):
        return lambda: (fn(), torch.cuda.synchronize())

    times = interleaved({k: synced(f) for k, f in fns.items()}, args.reps, args.warmup, shuffle=True)
    peak = get_device(preset).flops_per_s(torch.bfloat16)
    r = Ratio("autopar-compiled", "autopar", times["autopar-compiled"], times["autopar"])
    print(r.line())
    if "torch-compiled" in times:
        print(Ratio("autopar-compiled", "torch-compiled", times["autopar-compiled"], times["torch-compiled"]).line())
    print(check("compiled/eager step time", r.ratio, 0.8))
    for key in ("autopar", "autopar-compiled"):
        mfu = out[key]["flops"] / (sorted(times[key])[len(times[key]) // 2] * peak)
        out[key]["mfu"] = mfu
        print(f"  {key}: predicted {out[key]['predicted_ms']:.1f} ms, measured "
              f"{sorted(times[key])[len(times[key]) // 2] * 1e3:.1f} ms")
        print(f"  {key}: first step {out[key]['first_step_s']:.1f} s, graph breaks {out[key]['graph_breaks']}, "
              + check("MFU", mfu, 0.55, le=False))
    out["times"] = times
    return [out]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller GPT, fewer repetitions")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 4], help="CPU rank counts (default 1 4)")
    ap.add_argument("--gpu-batch", type=int, default=8, help="GPU variant: sequences per step")
    ap.add_argument("--skip-torch", action="store_true",
                    help="GPU variant: leave torch.compile(model) out (three 1.3B copies exceed 80 GB)")
    ap.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    args = ap.parse_args(argv)
    args.reps = args.reps or (5 if args.quick else 15)
    print(header("bench/compile.py: eager vs compiled per-rank programs"))
    results = gpu_main(args) if torch.cuda.is_available() else cpu_main(args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
