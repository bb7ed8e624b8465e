"""Measure this machine for the "cpu" device preset (``autopar calibrate``).

One rank = one process with one thread, as multi-rank CPU runs use it. Measured:

- matmul FLOP/s, ``2*n^3 / t`` for square fp32 (and bf16) matmuls of several sizes;
  the best becomes ``peak_flops``; ``compute_efficiency`` = median rate of a linear
  layer's three training matmuls (transposed operands) / peak;
- memory bandwidth, ``2 * nbytes / t`` of a large out-of-place op (read + write);
- matmul efficiency by smallest dimension (the linears of a training step on 8..1024 tokens)
  and fused attention's efficiency;
- kernel overhead, per kernel of a small transformer's training step at tiny sizes;
- sharing: how much slower one of k processes running at once is (compute, memory, overhead);
- optimizer step, seconds of ``torch.optim.AdamW.step`` per parameter, stored as the bytes
  per parameter that the measured memory bandwidth moves in that time, and per parameter tensor;
- compiled speedup: eager / ``torch.compile`` (inductor) time of a small matmul + elementwise
  block's forward + backward (``compiled_speedup``: what ``compile=True`` programs are costed at);
- gloo collective alpha/beta on loopback for 2 and 4 processes: all_reduce times fitted by
  least squares to ``t = 2(p-1) * alpha + 2(p-1)/p * n * beta``; bandwidth = 1/beta; and the same
  fit per process count (``shared_links``: with more processes than cores a hop waits for the
  scheduler).

The profile is JSON at ``~/.cache/autopar/cpu_profile.json`` (env ``AUTOPAR_PROFILE``
overrides) and names the machine it was measured on (cpu model, core count, torch).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

from autopar.core import rank_start
from autopar.core.allocator import keep_freed_memory

from .profile import PROFILE_VERSION, fingerprint, profile_path, save_profile

# ---- single-process measurements --------------------------------------------------------


def median_time(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_matmul(sizes: Sequence[int], dtype: torch.dtype = torch.float32, reps: int = 5) -> dict[int, float]:
    """FLOP/s of an ``n x n @ n x n`` matmul per size: ``2 n^3 / t``."""
    out = {}
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        out[n] = 2.0 * n**3 / median_time(lambda: torch.mm(a, b), reps)
    return out


def measure_matmul_efficiency(n: int, peak: float, reps: int = 5) -> float:
    """Median over the three matmuls of a linear layer's training step (``x @ w.T``,
    ``g @ w``, ``g.T @ x``; shapes ``n x n``, ``n x 2n``) of ``rate / peak``, at most 1."""
    x, w, g = torch.randn(n, n), torch.randn(2 * n, n), torch.randn(n, 2 * n)
    flops = 2.0 * n * n * 2 * n
    rates = [
        flops / median_time(fn, reps)
        for fn in (lambda: torch.mm(x, w.t()), lambda: torch.mm(g, w), lambda: torch.mm(g.t(), x))
    ]
    return min(1.0, statistics.median(rates) / peak)


def measure_matmul_curve(peak: float, dims: Sequence[int], width: int = 1024, reps: int = 5,
                         kernel_overhead: float = 2e-5, memory_bandwidth: float = 5e9) -> list[list[float]]:
    """``[[d, efficiency], ...]`` of matmuls inside a training step on ``d`` tokens: forward +
    backward (gradients freed each step, as ``zero_grad`` does) of three ``width x width``
    linears with GELUs, its time less what the cost model gives the rest (the kernel launches,
    the GELUs and the loss at ``memory_bandwidth``), against the linears' FLOPs at ``peak``.
    The matmuls of a real step run slower than the same matmul in a loop (cold caches, freshly
    allocated gradients): 2-3x at 16 tokens here."""
    from autopar.frontend.trace import trace

    from .compute import node_work

    out = []
    for d in dims:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                                    torch.nn.GELU(), torch.nn.Linear(width, width))
        x = torch.randn(d, width)
        gm = trace(model, (x,)).gm
        works = [node_work(n) for n in gm.graph.nodes if n.op == "call_function"]
        mm_flops = sum(f for w in works for _, f in w.matmuls_fwd + w.matmuls_bwd)
        rest = sum(w.kernels_fwd + w.kernels_bwd for w in works) * kernel_overhead + sum(
            (w.bytes_fwd + w.bytes_bwd) / memory_bandwidth for w in works if not (w.matmuls_fwd or w.matmuls_bwd))

        def step():
            model(x).sum().backward()
            model.zero_grad(set_to_none=True)

        t = median_time(step, reps, 2) - rest
        out.append([int(min(d, width)), min(1.0, mm_flops / max(t, 1e-9) / peak)])
    return out


def measure_attention_efficiency(peak: float, shape: Sequence[int] = (4, 8, 128, 32), reps: int = 5) -> float:
    """Fraction of ``peak`` that causal ``scaled_dot_product_attention`` forward + backward reaches
    on ``[batch, heads, seq, head_dim]``, counting the FLOPs the cost model counts for it
    (``4 b h s^2 d`` forward, twice that backward)."""
    b, h, s, d = shape
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    seed = torch.randn(b, h, s, d)

    def step():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), seed)

    return min(1.0, 3 * 4.0 * b * h * s * s * d / median_time(step, reps, 2) / peak)


def measure_memory_bandwidth(nbytes: int, reps: int = 5) -> float:
    """Bytes/s of an out-of-place op on ``nbytes`` (``torch.neg``): ``2 * nbytes / t``.

    Out-of-place like most ops of a training step, so the output's allocation (page
    faults on fresh memory) is part of the measured rate.
    """
    src = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
    return 2.0 * src.numel() * 4 / median_time(lambda: torch.neg(src), reps)


class _TinyBlock(torch.nn.Module):
    """A pre-LN transformer block at sizes where dispatch, not arithmetic, takes the time."""

    def __init__(self, hidden: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv, self.proj = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(h, -1))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


def measure_kernel_overhead(reps: int = 20) -> float:
    """Seconds per kernel in a training step of real ops at tiny sizes: forward + backward of two
    pre-LN transformer blocks on a [1, 4, 16] input and an MSE loss (eager autograd), divided by
    the kernels the cost model counts in their aten graph (``compute.node_work``). At these sizes
    arithmetic takes a few percent of the time; what is left is the framework's per-op cost
    (dispatch, autograd bookkeeping, allocation), which a chain of one cheap op underestimates."""
    from autopar.frontend.trace import trace

    from .compute import node_work

    torch.manual_seed(0)
    model = torch.nn.Sequential(_TinyBlock(), _TinyBlock())
    x, y = torch.randn(1, 4, 16), torch.randn(1, 4, 16)
    loss_fn = torch.nn.functional.mse_loss
    gm = trace(model, (x,), loss_fn, y).gm
    works = [node_work(n) for n in gm.graph.nodes if n.op == "call_function"]
    kernels = sum(w.kernels_fwd + w.kernels_bwd for w in works)

    def step():
        loss_fn(model(x), y).backward()

    return max(median_time(step, reps, 3) / max(kernels, 1), 1e-7)


class _MlpBlock(torch.nn.Module):
    """``layer_norm(x + 0.5 * fc2(gelu(fc1(x))))``: two matmuls and the elementwise ops inductor fuses."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)
        self.ln = torch.nn.LayerNorm(hidden)

    def forward(self, x):
        return self.ln(x + 0.5 * self.fc2(torch.nn.functional.gelu(self.fc1(x))))


def measure_compiled_speedup(tokens: int = 128, hidden: int = 64, reps: int = 15) -> float:
    """Eager seconds / compiled seconds of one training step (forward + backward) of
    ``_MlpBlock(hidden)`` on ``[tokens, hidden]``, compiled by ``torch.compile`` (inductor,
    static shapes) as ``compile=True`` compiles a rank's program; median of ``reps`` each, after
    the compile. Below 1 where the compiled graph's runtime wrappers cost more than fusion saves
    (tiny ops on a CPU)."""
    torch.manual_seed(0)
    block = _MlpBlock(hidden)
    x = torch.randn(tokens, hidden, requires_grad=True)
    compiled = torch.compile(block, backend="inductor", dynamic=False)

    def step(fn):
        return lambda: fn(x).sum().backward()

    eager_s = median_time(step(block), reps, 3)
    compiled_s = median_time(step(compiled), reps, 3)
    return eager_s / compiled_s


def measure_optimizer_seconds_per_param(numel: int = 1 << 22, tensors: int = 4, reps: int = 5) -> float:
    """Seconds per parameter of one AdamW step (torch's default implementation) over
    ``numel`` fp32 parameters in ``tensors`` tensors."""
    params = [torch.nn.Parameter(torch.randn(numel // tensors)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    return median_time(opt.step, reps, 2) / (numel // tensors * tensors)


def measure_optimizer_tensor_overhead(tensors: int = 50, reps: int = 9) -> float:
    """Seconds per parameter tensor of one AdamW step: ``tensors`` tiny tensors against one."""
    def step_time(n: int) -> float:
        params = [torch.nn.Parameter(torch.randn(256)) for _ in range(n)]
        for p in params:
            p.grad = torch.randn_like(p)
        return median_time(torch.optim.AdamW(params, lr=1e-3).step, reps, 2)

    return max((step_time(tensors) - step_time(1)) / (tensors - 1), 1e-7)


# ---- ranks sharing the cores ------------------------------------------------------------


def _sharing_worker(rank: int, barrier, seconds: float, out: str) -> None:
    keep_freed_memory()
    torch.set_num_threads(1)
    a = torch.randn(512, 512)
    big = torch.ones(4 << 20)
    model = torch.nn.Sequential(_TinyBlock(), _TinyBlock())
    x = torch.randn(1, 4, 16)

    def small():
        model(x).sum().backward()

    row = []
    for fn in (lambda: torch.mm(a, a), lambda: torch.neg(big), small):
        for _ in range(3):
            fn()
        barrier.wait()
        count, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            fn()
            count += 1
        row.append((time.perf_counter() - t0) / count)
    Path(f"{out}.{rank}").write_text(json.dumps(row), encoding="utf-8")


def measure_sharing(ranks: Sequence[int], seconds: float = 1.0) -> list[list[float]]:
    """``[[k, compute, memory, overhead], ...]``: how much slower one of ``k`` processes (one
    thread each, all running at once) is than one process alone, on a 512 matmul (compute),
    an out-of-place op on 16 MiB (memory bandwidth) and a tiny transformer's training step
    (per-kernel overhead). Mean time per call over ``seconds``, so time slices lost to the
    other processes count; the slowest process's mean is taken."""
    import torch.multiprocessing as mp

    ctx = rank_start.pool_context()
    means = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k in sorted({1, *ranks}):
            out = os.path.join(tmp, f"k{k}")
            barrier = ctx.Barrier(k)
            procs = [ctx.Process(target=_sharing_worker, args=(r, barrier, seconds, out)) for r in range(k)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(timeout=60 + 10 * seconds)
                if p.exitcode != 0:
                    raise RuntimeError(f"sharing calibration: a worker of {k} processes failed (exit {p.exitcode})")
            rows = [json.loads(Path(f"{out}.{r}").read_text(encoding="utf-8")) for r in range(k)]
            means[k] = [max(col) for col in zip(*rows)]
    return [[k, *(max(1.0, v / b) for v, b in zip(means[k], means[1]))] for k in sorted(means) if k > 1]


# ---- collectives over gloo ---------------------------------------------------------


def free_port() -> int:
    """A TCP port nobody listens on now (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collective_worker(rank: int, world: int, port: int, sizes: list[int], reps: int, out: str) -> None:
    import torch.distributed as dist

    keep_freed_memory()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        rows = []
        for nbytes in sizes:
            t = torch.ones(max(nbytes // 4, 1))
            for _ in range(2):
                dist.all_reduce(t)
            times = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(t)
                times.append(time.perf_counter() - t0)
            slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            rows.append([world, t.numel() * 4, float(slowest)])
        if rank == 0:
            Path(out).write_text(json.dumps(rows), encoding="utf-8")
    finally:
        dist.destroy_process_group()


def measure_all_reduce(world: int, sizes: Sequence[int], reps: int = 5) -> list[list[float]]:
    """``[[p, nbytes, seconds], ...]`` of gloo all_reduce on loopback with ``world`` procs."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.start_processes(_collective_worker, args=(world, free_port(), list(sizes), reps, out), nprocs=world,
                           start_method=rank_start.start_method())
        return json.loads(Path(out).read_text(encoding="utf-8"))


def fit_alpha_beta(rows: Sequence[Sequence[float]]) -> tuple[float, float]:
    """Least squares of ring all_reduce ``t = 2(p-1) alpha + 2(p-1)/p n beta`` -> (alpha, beta),
    in relative error (each row divided by its measured ``t``) so small messages count.

    Non-negative: when the joint fit makes one coefficient negative, it is set to its
    floor (alpha 1e-7 s, beta 1e-12 s/byte) and the other is fitted alone.
    """
    a = np.array([[2.0 * (p - 1), 2.0 * (p - 1) / p * n] for p, n, _ in rows])
    t = np.array([row[2] for row in rows])
    a = a / t[:, None]
    ones = np.ones_like(t)
    (alpha, beta), *_ = np.linalg.lstsq(a, ones, rcond=None)
    floor = (1e-7, 1e-12)
    if alpha < floor[0] or beta < floor[1]:
        keep = 1 if alpha < floor[0] else 0
        fixed = 1 - keep
        rest = ones - a[:, fixed] * floor[fixed]
        coef = max(float(a[:, keep] @ rest / (a[:, keep] @ a[:, keep])), floor[keep])
        alpha, beta = (floor[0], coef) if keep == 1 else (coef, floor[1])
    return max(float(alpha), floor[0]), max(float(beta), floor[1])


# ---- the whole calibration -------------------------------------------------------------


def _measure_links(world_sizes: Sequence[int], collective_sizes: Sequence[int],
                   reps: int) -> tuple[list[list[float]], float, float, list[list[float]]]:
    """All-reduce timings over each world size, the (alpha, beta) fitted to all of them, and
    [world, latency, bandwidth] fitted per world size (``shared_links``)."""
    rows: list[list[float]] = []
    for world in world_sizes:
        rows += measure_all_reduce(world, collective_sizes, reps)
    alpha, beta = fit_alpha_beta(rows) if rows else (5e-5, 1e-9)
    links = []
    for world in world_sizes:
        mine = [r for r in rows if r[0] == world]
        if len(mine) >= 2:
            a, b = fit_alpha_beta(mine)
            links.append([world, a, 1.0 / b])
    return rows, alpha, beta, links


def calibrate(
    out_path: str | os.PathLike | None = None,
    quick: bool = False,
    *,
    matmul_sizes: Sequence[int] | None = None,
    matmul_dims: Sequence[int] | None = None,
    sharing_seconds: float | None = None,
    copy_bytes: int | None = None,
    collective_sizes: Sequence[int] | None = None,
    world_sizes: Sequence[int] = (2, 4),
    reps: int | None = None,
    save: bool = True,
    compiled: bool = True,
) -> dict:
    """Measure this machine and save the profile (``out_path`` or :func:`profile_path`).

    ``quick`` uses fewer sizes and repetitions (well under a minute); the keyword
    arguments override sizes for tests; ``compiled=False`` skips the compiled speedup (inductor's
    first compile takes seconds; the profile then leaves it at the default). Returns the profile dict.
    """
    reps = reps or (3 if quick else 7)
    matmul_sizes = matmul_sizes or ((128, 256, 512) if quick else (128, 256, 512, 1024, 2048))
    matmul_dims = matmul_dims or ((8, 32, 128, 512) if quick else (8, 16, 32, 64, 128, 256, 512, 1024))
    sharing_seconds = sharing_seconds or (0.5 if quick else 1.5)
    copy_bytes = copy_bytes or 16 * 2**20  # a typical activation: larger ones page-fault more
    collective_sizes = collective_sizes or (
        (2**12, 2**16, 2**20, 2**22) if quick else (2**10, 2**12, 2**14, 2**16, 2**18, 2**20, 2**22, 2**24)
    )
    keep_freed_memory()   # as the ranks run (autopar.runtime.launch)
    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32 = measure_matmul(matmul_sizes, torch.float32, reps)
        bf16 = measure_matmul(matmul_sizes[: max(1, len(matmul_sizes) - 1)], torch.bfloat16, reps)
        efficiency = measure_matmul_efficiency(max(matmul_sizes), max(fp32.values()), reps)
        bandwidth = measure_memory_bandwidth(copy_bytes, reps)
        overhead = measure_kernel_overhead()
        curve = measure_matmul_curve(max(fp32.values()), matmul_dims, reps=reps, kernel_overhead=overhead,
                                     memory_bandwidth=bandwidth)
        attention = measure_attention_efficiency(max(fp32.values()), reps=reps)
        optimizer_s = measure_optimizer_seconds_per_param(reps=reps)
        optimizer_tensor = measure_optimizer_tensor_overhead()
        speedup = measure_compiled_speedup(reps=max(reps, 5)) if compiled else None
    finally:
        torch.set_num_threads(threads)
    sharing = measure_sharing(world_sizes, sharing_seconds) if world_sizes else []
    rows, alpha, beta, links = _measure_links(world_sizes, collective_sizes, reps)
    profile = {
        "version": PROFILE_VERSION,
        "machine": fingerprint(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "quick": bool(quick),
        "matmul_flops": {"fp32": {str(k): v for k, v in fp32.items()}, "bf16": {str(k): v for k, v in bf16.items()}},
        "peak_flops": {"fp32": max(fp32.values()), "bf16": max(bf16.values())},
        "compute_efficiency": efficiency,
        "matmul_efficiency": curve,
        "attention_efficiency": attention,
        "sharing": sharing,
        "memory_bandwidth": bandwidth,
        "kernel_overhead": overhead,
        "optimizer_s_per_param": optimizer_s,
        "optimizer_bytes_per_param": optimizer_s * bandwidth,
        "optimizer_tensor_overhead": optimizer_tensor,
        **({"compiled_speedup": speedup} if speedup is not None else {}),
        "collectives": {"all_reduce": rows},
        "link": {"bandwidth": 1.0 / beta, "latency": alpha},
        "shared_links": links,
        "seconds": round(time.perf_counter() - started, 2),
    }
    if save:
        profile["path"] = str(save_profile(profile, out_path))
    return profile


def summary(profile: dict) -> str:
    """A few lines for humans."""
    link = profile["link"]
    return "\n".join(
        [
            f"machine: {profile['machine']['cpu_model']} ({profile['machine']['nproc']} cores, torch {profile['machine']['torch']})",
            f"matmul fp32 peak: {profile['peak_flops']['fp32'] / 1e9:.1f} GFLOP/s per thread"
            f" (bf16 {profile['peak_flops']['bf16'] / 1e9:.1f})",
            f"memory bandwidth: {profile['memory_bandwidth'] / 1e9:.2f} GB/s per thread",
            f"kernel overhead: {profile['kernel_overhead'] * 1e6:.1f} us",
            "matmul efficiency by smallest dimension: "
            + ", ".join(f"{d}: {e:.2f}" for d, e in profile.get("matmul_efficiency", [])),
            f"attention efficiency: {profile.get('attention_efficiency') or float('nan'):.2f}",
            "ranks sharing the cores (compute, memory, overhead slowdown): "
            + "; ".join(f"{k}: {c:.2f} {m:.2f} {o:.2f}" for k, c, m, o in profile.get("sharing", [])),
            f"AdamW step: {profile.get('optimizer_s_per_param', float('nan')) * 1e9:.1f} ns/param "
            f"({profile.get('optimizer_bytes_per_param', float('nan')):.0f} bytes/param at the measured bandwidth)",
            f"compiled (torch.compile) speedup: {profile.get('compiled_speedup', float('nan')):.2f}x eager",
            f"gloo loopback: alpha {link['latency'] * 1e6:.1f} us, bandwidth {link['bandwidth'] / 1e9:.2f} GB/s"
            + "".join(f"; {k} ranks: {a * 1e6:.0f} us, {b / 1e9:.2f} GB/s" for k, a, b in profile.get("shared_links", [])),
            f"saved to {profile.get('path', '-')} in {profile['seconds']} s",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``autopar calibrate [--quick] [--out PATH]``."""
    parser = argparse.ArgumentParser(prog="autopar calibrate", description="Measure this machine for the cost model.")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (< 1 minute)")
    parser.add_argument("--out", default=None, help=f"profile path (default {profile_path()})")
    args = parser.parse_args(argv)
    print(summary(calibrate(args.out, quick=args.quick)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
