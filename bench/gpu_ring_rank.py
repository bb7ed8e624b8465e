"""One ring rank's attention compute on one device, as the runtime runs it, against the cost model's charge.

A rank of causal ring attention over ``n`` ranks holds its queries (zig-zag: chunks ``r`` and
``2n-1-r`` of ``2n``; contiguous: piece ``r``) and, over the ring's ``n`` steps, every rank's
key/value block. This script runs that rank's forward and backward with every block already local
(no ring: what one GPU can show) through the runtime's own per-block code
(``collectives/attention_cp._attend`` / ``_attend_grad``: the visible tiles of each block, fused
kernels where the device has them, blocks merged by log-sum-exp), checks it against one
``scaled_dot_product_attention`` call of the same queries on the whole keys (forward and the three
gradients), and times it. The charge printed beside it is ``cost_models.cp_tiles.ring_compute``
for the same shape on the named preset: per ring step the busiest rank's tiles, summed over the
steps, plus the once-per-op work (a bound on every rank's own sum).

    python bench/gpu_ring_rank.py [--device cuda] [--seq 32768] [--n 8] [--heads 32] [--ranks 0,4,7]
                                  [--contiguous] [--preset h200]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from autopar.collectives import attention_cp as cp  # noqa: E402
from autopar.cost_models.cp_tiles import AttnShape, ring_compute  # noqa: E402
from autopar.cost_models.devices import get_device  # noqa: E402
from bench.gpu_calibration import timed  # noqa: E402
from bench.gpu_ring_blocks import add_shape_args  # noqa: E402


def positions(rank: int, n: int, seq: int, zigzag: bool, device) -> torch.Tensor:
    """Global sequence positions a rank holds (queries and its own key/value block)."""
    if not zigzag:
        piece = seq // n
        return torch.arange(rank * piece, (rank + 1) * piece, device=device)
    half = seq // (2 * n)
    a, b = cp.zigzag_chunks(rank, n)
    return torch.cat([torch.arange(a * half, (a + 1) * half, device=device),
                      torch.arange(b * half, (b + 1) * half, device=device)])


def rank_attention(q, k, v, qpos, kpos: list[torch.Tensor], cuts: list | None = None):
    """(out, dq, dk, dv) of the rank's queries against every block ``kpos[s]`` of ``k`` / ``v`` (rows by
    position), block by block in the ring's order, forward then backward as ``_RingAttention`` runs them
    (``cuts[s]``: block s's tiles, cut once on the CPU as the runtime's ``block_cuts``)."""
    cuts = cuts or [None] * len(kpos)
    scale = q.shape[-1] ** -0.5
    out, lse = cp._start(q, v)
    aux: dict = {}
    blocks = [(k[..., kp, :], v[..., kp, :], kp, cut) for kp, cut in zip(kpos, cuts)]
    for kb, vb, kp, cut in blocks:
        cp._attend(q, kb, vb, None, qpos, kp, True, scale, out, lse, aux, cut)
    out = out.to(q.dtype)
    g = torch.ones_like(out)
    delta = (g.to(cp._acc(q)) * out.to(cp._acc(q))).sum(-1)
    dq = torch.zeros_like(q, dtype=cp._acc(q))
    dks, dvs = [], []
    for kb, vb, kp, cut in blocks:
        dk, dv = torch.zeros_like(kb, dtype=cp._acc(q)), torch.zeros_like(vb, dtype=cp._acc(q))
        cp._attend_grad(q, kb, vb, None, qpos, kp, True, scale, g, out, lse, delta, dq, dk, dv, aux, cut)
        dks.append(dk)
        dvs.append(dv)
    return out, dq, dks, dvs


def ring_cuts(args, rank: int) -> list:
    """The runtime's tiles of each block ``s`` of ``rank_attention`` (source rank ``rank - s``)."""
    by_source = cp.block_cuts(args.seq, (args.n,), (rank,), not args.contiguous, True)
    return [by_source[(rank - s) % args.n] for s in range(args.n)]


def check_and_time(args, rank: int, dev: str, dt) -> dict:
    """Errors against one SDPA call and the median forward + backward seconds of one rank."""
    zigzag = not args.contiguous
    kpos = [positions((rank - s) % args.n, args.n, args.seq, zigzag, dev) for s in range(args.n)]
    qpos = positions(rank, args.n, args.seq, zigzag, dev)
    cuts = ring_cuts(args, rank)
    g = torch.Generator(device=dev).manual_seed(rank)
    k = torch.randn(1, args.heads, args.seq, args.dim, device=dev, dtype=dt, generator=g)
    v = torch.randn(1, args.heads, args.seq, args.dim, device=dev, dtype=dt, generator=g)
    q = torch.randn(1, args.heads, len(qpos), args.dim, device=dev, dtype=dt, generator=g)
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=qpos[:, None] >= torch.arange(args.seq, device=dev))
    ref.backward(torch.ones_like(ref))
    with torch.no_grad():
        out, dq, dks, dvs = rank_attention(q, k, v, qpos, kpos, cuts)
        dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
        for kp, a, b in zip(kpos, dks, dvs):
            dk[..., kp, :] += a
            dv[..., kp, :] += b
        err = [float((a.float() - b.float()).abs().max() / b.float().abs().max())
               for a, b in zip((out, dq, dk, dv), (ref, qr.grad, kr.grad, vr.grad))]
        seconds = timed(lambda: rank_attention(q, k, v, qpos, kpos, cuts), dev, reps=args.reps, warmup=2)
        unsynced = timed(lambda: rank_attention(q, k, v, qpos, kpos), dev, reps=args.reps, warmup=1)
    return {"rank": rank, "seconds": seconds, "seconds_tiles_cut_per_block": unsynced,
            "rel_err_out_dq_dk_dv": [round(e, 5) for e in err]}


def profile(args, rank: int, dev: str, dt) -> dict:
    """Per forward + backward of one rank (CUDA): the kernels' own time, their count, and the wall time,
    from ``torch.profiler`` over 3 runs: where the GPU idles between kernels, the launches bind."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    zigzag = not args.contiguous
    kpos = [positions((rank - s) % args.n, args.n, args.seq, zigzag, dev) for s in range(args.n)]
    qpos = positions(rank, args.n, args.seq, zigzag, dev)
    cuts = ring_cuts(args, rank)
    q = torch.randn(1, args.heads, len(qpos), args.dim, device=dev, dtype=dt)
    k = torch.randn(1, args.heads, args.seq, args.dim, device=dev, dtype=dt)
    v = torch.randn(1, args.heads, args.seq, args.dim, device=dev, dtype=dt)
    with torch.no_grad():
        for _ in range(2):
            rank_attention(q, k, v, qpos, kpos, cuts)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(3):
                rank_attention(q, k, v, qpos, kpos, cuts)
            b.record()
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 3 / 1e6
    top: dict = {}
    for e in kernels:
        top[e.name[:60]] = top.get(e.name[:60], 0.0) + e.time_range.elapsed_us() / 3 / 1e3
    return {"rank": rank, "wall_s": a.elapsed_time(b) / 3 / 1e3, "kernel_s": busy, "kernels": len(kernels) // 3,
            "top_ms": dict(sorted(top.items(), key=lambda kv: -kv[1])[:8])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap)
    ap.add_argument("--ranks", default=None, help="comma-separated ranks (default: 0, n/2, n-1)")
    ap.add_argument("--contiguous", action="store_true", help="contiguous pieces instead of the zig-zag order")
    ap.add_argument("--preset", default="h200", help="the cost model's device preset to print the charge on")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="CUDA: the kernels' time and count against the wall time")
    args = ap.parse_args(argv)
    dev = args.device
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else sorted({0, args.n // 2, args.n - 1})
    if dev == "cuda":
        print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    shape = AttnShape(args.heads, args.heads, args.seq, args.dim, args.dim, torch.bfloat16, True, True)
    fwd, bwd, fixed = ring_compute(shape, (args.n,), not args.contiguous, get_device(args.preset))
    charge = sum(fwd) + sum(bwd) + fixed.total
    for rank in ranks:
        if args.profile:
            print(json.dumps(profile(args, rank, dev, dt)), flush=True)
            continue
        row = check_and_time(args, rank, dev, dt)
        row.update(seq=args.seq, n=args.n, heads=args.heads, zigzag=not args.contiguous, preset=args.preset,
                   charged_s=charge, measured_over_charged=row["seconds"] / charge)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
