"""Memory model accuracy: the plan's predicted peak per device vs the measured one.

    PYTHONPATH=. python bench/memory_accuracy.py                 # CPU count, every case
    PYTHONPATH=. python bench/memory_accuracy.py -k "gpt dp2"    # cases whose name contains it
    PYTHONPATH=. python bench/memory_accuracy.py --cuda          # torch.cuda.max_memory_allocated

CPU (default): each case runs on its ranks (gloo, spawned) and counts parameters, gradients and
optimizer state exactly and the saved-activation peak with saved_tensors_hooks
(``bench/memory_measure.py``); the prediction is ``plan.memory_per_device[rank]`` (state + saved
activations). The ratio is predicted / measured on the fullest rank. A second table compares the
predicted peak (with the transient workspace) with the live peak of every storage over a step
(``memory_measure.LivePeak``: what an allocator must hold, short of rounding and fragmentation).

``--cuda``: the same cases on GPUs: a case runs when the machine has as many GPUs as its ranks
(nccl, one process per GPU; a 1-GPU machine runs the cases rerun on one rank with ``--single``),
and reports ``torch.cuda.max_memory_allocated`` over one training step after a warm-up step, minus
nothing: the allocator's peak includes transient workspace (forward temporaries, the gradients
flowing in backward, communication buffers) that the plan's per-device number does not model, so
expect measured > predicted by the largest layer's temporaries. Exits with a message when no GPU
is present.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.memory_measure import CASES, GB, Case, build_case, measure_step, predicted, run_case  # noqa: E402


def _cuda_job(rank: int, name: str, single: bool) -> dict:
    """One rank's ``torch.cuda.max_memory_allocated`` over a training step (after a warm-up step)."""
    import torch.distributed as dist

    case = _single(CASES[name]) if single else CASES[name]
    torch.cuda.set_device(rank % torch.cuda.device_count())
    pmodel, opt, x, y = build_case(case, device="cuda")
    count = measure_step(pmodel, opt, (x,), y, steps=1)        # warm-up: gradients and states exist
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    count = measure_step(pmodel, opt, (x,), y, steps=1)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    if dist.is_initialized():
        dist.barrier()
    return {"case": case.name, "rank": rank, "measured": {**count.as_dict(), "total": peak, "before_step": base},
            "predicted": predicted(pmodel.plan, rank)}


def _single(case: Case) -> Case:
    """The case on one device: the same model and per-device batch, mesh (1,)."""
    dp = case.mesh[0] if case.mode == "data" or (case.axes and case.axes[0] == "dp") else 1
    # stand_alone: on a 1-device mesh "data" mode still inserts size-1 collectives that copy
    return dataclasses.replace(case, name=case.name + " [1 GPU]", batch=case.batch // dp, mesh=(1,), axes=None,
                               mode="stand_alone", context=tuple(c for c in case.context if c[0] != "microbatches"))


def _run_cpu(cases: list[Case]) -> list[dict]:
    from autopar.runtime.launch import RankPool

    pools: dict[int, RankPool] = {}
    rows, live = [], []
    try:
        for case in cases:
            pool = pools.get(case.world)
            if pool is None:
                pool = pools[case.world] = RankPool(case.world, timeout_s=300)
            t0 = time.perf_counter()
            results = pool.run(run_case, case.name)
            seconds = time.perf_counter() - t0
            rows.append(_row(case.name, results, seconds))
            live.append(_row(case.name, results, seconds, key="peak", measured="live"))
    finally:
        for pool in pools.values():
            pool.close()
    return rows, live


def _nccl_job(rank: int, name: str) -> dict:
    return _cuda_job(rank, name, False)


def _run_cuda(cases: list[Case], single: bool) -> list[dict]:
    if not torch.cuda.is_available():
        sys.exit("--cuda: no CUDA GPU is visible to torch (torch.cuda.is_available() is False); "
                 "run the CPU count without --cuda, or on a machine with a GPU")
    gpus = torch.cuda.device_count()
    rows = []
    for case in cases:
        t0 = time.perf_counter()
        if single or case.world == 1:
            results = [_cuda_job(0, case.name, case.world > 1)]
            name = results[0]["case"]
        elif case.world <= gpus:
            results = _launch_nccl(case)
            name = case.name
        else:
            print(f"skip {case.name!r}: needs {case.world} GPUs, this machine has {gpus} (try --single)")
            continue
        rows.append(_row(name, results, time.perf_counter() - t0, key="peak"))
    return rows


def _launch_nccl(case: Case) -> list[dict]:
    """One process per GPU, nccl (``torch.multiprocessing.spawn`` with a file rendezvous)."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_nccl_entry, args=(case.world, os.path.join(tmp, "rdzv"), case.name, tmp), nprocs=case.world)
        import json

        return [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(case.world)]


def _nccl_entry(rank: int, world: int, rdzv: str, name: str, out: str) -> None:
    import json

    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{rdzv}", rank=rank, world_size=world)
    try:
        res = _nccl_job(rank, name)
        with open(os.path.join(out, f"{rank}.json"), "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()


def _row(name: str, results: list[dict], seconds: float, key: str = "total", measured: str = "total") -> dict:
    """The fullest rank (largest measured value) stands for the case; ``key`` picks the prediction
    compared: "total" (state + saved activations, the CPU count) or "peak" (+ transient workspace,
    what max_memory_allocated sees); ``measured`` the measurement: "total" (the count) or "live"
    (every live storage at the step's worst moment, ``memory_measure.LivePeak``)."""
    r = max(results, key=lambda r: r["measured"][measured])
    pred, meas = r["predicted"][key], r["measured"][measured]
    return {"case": name, "rank": r["rank"], "predicted": pred, "measured": meas, "ratio": pred / meas, "kind": measured,
            "detail": r, "seconds": seconds}


def print_table(rows: list[dict], what: str) -> None:
    print(f"{'case':32s} {'rank':>4s} {'predicted GB':>13s} {'measured GB':>12s} {'ratio':>6s}   ({what})")
    for row in rows:
        m = row["detail"]["measured"]
        extra = ""
        if row.get("kind") == "live":
            p = row["detail"]["predicted"]
            extra = f"  (predicted transient {p.get('transient', 0) / GB:.4f}; count {m['total'] / GB:.4f})"
        elif "before_step" in m:
            p = row["detail"]["predicted"]
            extra = (f"  (count: state {m['state'] / GB:.4f} + saved {m['activations'] / GB:.4f}; predicted "
                     f"state+saved {p['total'] / GB:.4f} + transient {p.get('transient', 0) / GB:.4f})")
        elif "state" in m:
            extra = (f"  state {m['state'] / GB:.4f} + acts {m['activations'] / GB:.4f}"
                     f" vs pred acts {row['detail']['predicted'].get('activations', float('nan')) / GB:.4f}")
        print(f"{row['case']:32s} {row['rank']:4d} {row['predicted'] / GB:13.4f} {row['measured'] / GB:12.4f} "
              f"{row['ratio']:6.3f}{extra}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", default="", help="run the cases whose name contains this")
    ap.add_argument("--cuda", action="store_true", help="measure torch.cuda.max_memory_allocated on GPUs")
    ap.add_argument("--single", action="store_true", help="--cuda: every case on one GPU (per-device batch)")
    ap.add_argument("--preset", default="h100", help="--cuda: the device preset planning assumes (default h100)")
    args = ap.parse_args(argv)
    os.environ["AUTOPAR_BENCH_PRESET"] = args.preset
    cases = [c for c in CASES.values() if args.k in c.name and (args.cuda or not c.gpu_only)]
    if not cases:
        sys.exit(f"no case matches {args.k!r}; cases: {', '.join(CASES)}")
    if args.cuda:
        rows = _run_cuda(cases, args.single)
        print_table(rows, "torch.cuda.max_memory_allocated")
    else:
        rows, live = _run_cpu(cases)
        print_table(rows, "CPU: exact state + saved-activation peak")
        print()
        print_table(live, "CPU: predicted peak vs live peak of every storage, memory_measure.LivePeak")


if __name__ == "__main__":
    main()
