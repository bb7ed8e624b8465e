"""Benchmark (issue 15 part 3): how long a dead or stalled rank takes to end the job.

Under ``autopar.launch(timeout_s=T)`` (the default group's timeout, which autopar's communication
timeout follows), 4 gloo ranks train a small GPT under DATA, TP (Megatron annotations) or a 4-stage
1F1B pipeline. At step 3 the victim rank (2) either dies (SIGKILL from a gradient hook, in the middle
of its backward) or stalls (sleeps before the step). Each survivor stamps the wall clock when its
``CommError`` is raised; the parent stamps when ``launch`` returns. Times are from the victim's stamp
just before it died or fell asleep. A survivor ``launch`` stopped before it failed (it was waiting on
a peer that had failed but not exited yet) has no time of its own.

``--mismatch``: rank 1 builds a wider model; the time from the last rank entering ``parallelize`` to
each rank's ``RankMismatchError``, and to ``launch`` returning.

    .venv/bin/python bench/peer_failure.py [--plans data tp pp] [--events kill stall] [--timeout 5] [--mismatch]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import autopar  # noqa: E402
from autopar.core.errors import CommError, RankMismatchError  # noqa: E402
from examples.models import GPT, lm_loss  # noqa: E402

VICTIM, AT_STEP, STEPS = 2, 2, 6        # rank 2 dies or stalls in the third step (0-based 2)


def _model(wider: bool = False) -> tuple[GPT, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(vocab=64, hidden=48 if wider else 32, heads=4, layers=4, seq=8, qkv_bias=False)
    return model, torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(1))


def _plan(plan: str):
    autopar.set_auto_parallel_context(autotune_top_k=0)
    if plan == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        autopar.shard({"blocks.*.fc1": ColwiseParallel()} | {f"blocks.*.{n}": RowwiseParallel() for n in ("proj", "fc2")},
                      axis="tp")
        autopar.shard("blocks.*.qkv", weight={"tp": autopar.Shard(0, 3)})
        return autopar.Mesh(4, axis_names=("tp",)), "semi_auto"
    if plan == "pp":
        autopar.set_auto_parallel_context(schedule="1f1b", microbatches=4)
        return autopar.Mesh(4, axis_names=("pp",)), "auto"
    return autopar.Mesh(4), "data"


def _stamp(folder: str, name: str, **data) -> None:
    with open(os.path.join(folder, f"{name}.json"), "w") as f:
        json.dump({"t": time.time(), **data}, f)


def _job(rank: int, plan: str, event: str, folder: str) -> None:
    mesh, mode = _plan(plan)
    model, x = _model()
    pm = autopar.parallelize(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=x, mode=mode)
    for step in range(STEPS):
        if step == AT_STEP and rank == VICTIM:
            if event == "stall":
                _stamp(folder, "event")
                time.sleep(3600)

            def die(grad):
                _stamp(folder, "event")
                os.kill(os.getpid(), signal.SIGKILL)
            next(pm.parameters()).register_hook(die)
        try:
            pm.step(x, target=x)
        except CommError as err:
            _stamp(folder, f"rank{rank}", degrees=pm.plan.degrees, message=str(err))
            raise


def _mismatch_job(rank: int, folder: str) -> None:
    autopar.set_auto_parallel_context(autotune_top_k=0)
    model, x = _model(wider=rank == 1)
    start = time.time()
    try:
        autopar.parallelize(model, autopar.Mesh(4), example_inputs=(x,), loss_fn=lm_loss, example_target=x,
                            mode="data")
    except RankMismatchError:
        _stamp(folder, f"rank{rank}", start=start)
        raise


def _read(folder: str, name: str) -> dict | None:
    path = os.path.join(folder, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def measure(plan: str, event: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="peer_failure_") as folder:
        try:
            autopar.launch(_job, nprocs=4, args=(plan, event, folder), timeout_s=timeout)
            raise SystemExit(f"{plan} {event}: launch returned without an error")
        except autopar.RankError as err:
            ended, lead = time.time(), str(err).splitlines()[0]
        t0 = _read(folder, "event")["t"]
        survivors = {r: _read(folder, f"rank{r}") for r in range(4) if r != VICTIM}
        degrees = next((s["degrees"] for s in survivors.values() if s), None)
        return {"plan": plan, "event": event, "timeout_s": timeout, "degrees": degrees,
                "error_after_s": {r: round(s["t"] - t0, 3) if s else None for r, s in survivors.items()},
                "launch_after_s": round(ended - t0, 3), "lead": lead[:160]}


def measure_mismatch(timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="peer_failure_") as folder:
        try:
            autopar.launch(_mismatch_job, nprocs=4, args=(folder,), timeout_s=timeout)
            raise SystemExit("mismatch: launch returned without an error")
        except autopar.RankError as err:
            ended, lead = time.time(), str(err).splitlines()[0]
        recs = [r for r in (_read(folder, f"rank{i}") for i in range(4)) if r]
        last_in = max(r["start"] for r in recs)
        return {"event": "mismatch", "timeout_s": timeout, "ranks_with_error": len(recs),
                "error_after_s": sorted(round(r["t"] - last_in, 3) for r in recs),
                "launch_after_s": round(ended - last_in, 3), "lead": lead[:160]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", nargs="+", default=["data", "tp", "pp"], choices=["data", "tp", "pp"])
    ap.add_argument("--events", nargs="+", default=["kill", "stall"], choices=["kill", "stall"])
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--mismatch", action="store_true", help="also time the rank-mismatch error")
    args = ap.parse_args()
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    for plan in args.plans:
        for event in args.events:
            print(json.dumps(measure(plan, event, args.timeout)), flush=True)
    if args.mismatch:
        print(json.dumps(measure_mismatch(args.timeout)), flush=True)


if __name__ == "__main__":
    main()
