"""A job whose training state does not fit once per rank: a GPT built on the meta device, planned
under AUTO with a per-device memory cap, initialized with ``pmodel.init_weights``, trained 2 AdamW
steps, saved (DCP) and exported (``save_pretrained``), on 4 CPU ranks. Each rank reports its peak RSS (VmHWM) after parallelize, after
init_weights, after the steps and after the save, against the plan's predicted per-device peak.

``--real`` runs the starting code's path instead: the model built for real on every rank (then
broadcast from rank 0 and cut), for measuring at a small ``--params`` what it needs per rank.

    PYTHONPATH=. python bench/big_model.py --params 0.1            # quick check (~100M parameters)
    PYTHONPATH=. python bench/big_model.py --params 0.75 --cap 5   # the big run
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from examples.models import GPT, lm_loss  # noqa: E402

GIB = 2 ** 30
VOCAB, SEQ, BATCH, HEAD_DIM = 8192, 64, 8, 128


def shape_for(params: float) -> dict:
    """A GPT shape (hidden, layers, heads) of about ``params`` billion parameters (12 h^2 per layer)."""
    hidden = 1024 if params < 0.3 else 1536 if params < 1.0 else 2048
    layers = max(1, round((params * 1e9 - (VOCAB + SEQ) * hidden) / (12 * hidden * hidden)))
    return {"vocab": VOCAB, "hidden": hidden, "heads": hidden // HEAD_DIM, "layers": layers, "seq": SEQ}


def peak_gib() -> float:
    """This process's peak resident memory (VmHWM), GiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / GIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def job(rank: int, shape: dict, cap: float, real: bool, out_dir: str, save_dir: str) -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    rec = {"rank": rank, "start": peak_gib()}
    t0 = time.perf_counter()
    if real:
        torch.manual_seed(0)
        model = GPT(**shape)                      # the whole model on every rank (the starting code's path)
    else:
        with torch.device("meta"):
            model = GPT(**shape)
    rec["params"] = sum(p.numel() for p in model.parameters())
    mesh = autopar.Mesh(4, device="cpu", memory_gb=cap)
    pm = autopar.parallelize(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=x, mode="auto")
    rec["parallelize_s"], rec["after_parallelize"] = time.perf_counter() - t0, peak_gib()
    rec["plan"] = {"degrees": pm.plan.degrees, "zero": pm.plan.memory_options.zero,
                   "recompute": str(pm.plan.memory_options.recompute),
                   "accumulation": pm.plan.memory_options.accumulation, "schedule": pm.plan.schedule}
    rec["predicted_gib"] = pm.plan.memory_per_device[rank] / GIB
    rec["local_params"] = sum(p.numel() for p in pm.parameters())
    if not real:
        t = time.perf_counter()
        pm.init_weights(seed=0)
        rec["init_s"], rec["after_init"] = time.perf_counter() - t, peak_gib()
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    rec["losses"], rec["step_s"] = [], []
    for _ in range(2):
        t = time.perf_counter()
        rec["losses"].append(float(pm.step(x, target=x)))
        opt.step()
        opt.zero_grad()
        rec["step_s"].append(time.perf_counter() - t)
    rec["after_steps"] = peak_gib()
    t = time.perf_counter()
    pm.save(save_dir)
    rec["save_s"], rec["after_save"] = time.perf_counter() - t, peak_gib()
    t = time.perf_counter()
    export = pm.save_pretrained(save_dir + "_export", max_shard_size="1GB")   # safetensors, streamed to rank 0
    rec["export_s"], rec["after_export"] = time.perf_counter() - t, peak_gib()
    rec["export_files"] = len(export.files) if rank == 0 else None
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=0.75, help="billions of parameters (about)")
    ap.add_argument("--cap", type=float, default=None, help="per-device memory cap, GiB (default: 16 B/param / 3)")
    ap.add_argument("--real", action="store_true", help="the starting code's path: build the model for real")
    ap.add_argument("--json", default=None, help="write the per-rank records here")
    args = ap.parse_args()
    shape = shape_for(args.params)
    n = (shape["vocab"] + shape["seq"]) * shape["hidden"] + shape["layers"] * (12 * shape["hidden"] ** 2
                                                                                 + 13 * shape["hidden"])
    cap = args.cap or math.ceil(16 * n / GIB / 3)
    print(f"GPT {shape}: {n / 1e9:.3f}B parameters; fp32 params+grads+AdamW = {16 * n / GIB:.1f} GiB "
          f"(x4 ranks = {64 * n / GIB:.1f} GiB); cap {cap} GiB per device", flush=True)
    with tempfile.TemporaryDirectory(prefix="big_model_") as tmp:
        save_dir = os.path.join(tmp, "ckpt")
        t = time.perf_counter()
        autopar.launch(job, nprocs=4, args=(shape, cap, args.real, tmp, save_dir))
        wall = time.perf_counter() - t
        recs = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(4)]
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(save_dir) for f in fs)
        exported = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(save_dir + "_export") for f in fs)
        shutil.rmtree(save_dir, ignore_errors=True)
        shutil.rmtree(save_dir + "_export", ignore_errors=True)
    for r in recs:
        bound = 1.3 * r["predicted_gib"] + 1.0
        print(f"rank {r['rank']}: local params {r['local_params'] / 1e6:.0f}M, peak RSS GiB: parallelize "
              f"{r['after_parallelize']:.2f}, init {r.get('after_init', float('nan')):.2f}, steps "
              f"{r['after_steps']:.2f}, save {r['after_save']:.2f}, export {r['after_export']:.2f}; predicted {r['predicted_gib']:.2f} "
              f"(bound 1.3x+1 = {bound:.2f}: {'ok' if r['after_export'] <= bound else 'OVER'}); losses "
              f"{[round(v, 4) for v in r['losses']]}", flush=True)
    print(f"plan {recs[0]['plan']}; parallelize {recs[0]['parallelize_s']:.0f} s, init "
          f"{recs[0].get('init_s', 0):.0f} s, steps {[round(s, 1) for s in recs[0]['step_s']]} s, save "
          f"{recs[0]['save_s']:.0f} s ({size / GIB:.2f} GiB on disk), save_pretrained {recs[0]['export_s']:.0f} s "
          f"({recs[0]['export_files']} safetensors files, {exported / GIB:.2f} GiB); wall {wall:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": shape, "params": n, "cap_gib": cap, "real": args.real, "ranks": recs,
                       "wall_s": wall, "checkpoint_bytes": size, "export_bytes": exported}, f, indent=1)


if __name__ == "__main__":
    main()
