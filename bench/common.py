"""Shared helpers for the benchmarks: interleaved timing across ranks, ratio summaries,
and peak-RSS measurement in a fresh subprocess.

Timing rule of this project (4 ranks on 2 cores are noisy, +-30 %): never compare single
absolute times. Run the contenders INTERLEAVED (A, B, A, B, ...) in the same process group,
report each one's median, the ratio of medians, and the spread (quartiles and min/max of the
per-round paired ratios A_i / B_i).
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def interleaved(fns: dict[str, Callable[[], object]], reps: int, warmup: int = 2,
                shuffle: bool = False) -> dict[str, list[float]]:
    """Seconds per call of every function, run round-robin ``reps`` times after ``warmup``
    rounds. Under torch.distributed (call on every rank, same order) each call starts after a
    barrier and its time is the slowest rank's (all-reduce MAX over ranks at the end).
    ``shuffle``: each round runs the functions in a new order (the same on every rank), so that
    no function always follows the same one (what ran before changes caches and the allocator)."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            if _dist_on():
                dist.barrier()
            fns[n]()
    times = {n: [] for n in names}
    for r in range(reps):
        order = random.Random(r).sample(names, len(names)) if shuffle else names
        for n in order:
            if _dist_on():
                dist.barrier()
            t0 = time.perf_counter()
            fns[n]()
            times[n].append(time.perf_counter() - t0)
    if _dist_on():
        t = torch.tensor([times[n] for n in names], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times = {n: t[i].tolist() for i, n in enumerate(names)}
    return times


def training_step(pmodel, x, y, lr: float = 1e-3) -> tuple[Callable[[], None], list[float]]:
    """One AdamW training step of ``pmodel`` on (x, y) as a closure, and the list its losses go to."""
    import torch

    opt = torch.optim.AdamW(pmodel.parameters(), lr=lr)
    losses: list[float] = []

    def step() -> None:
        loss = pmodel.step(x, target=y)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))

    return step, losses


def quartiles(xs: Sequence[float]) -> tuple[float, float, float]:
    xs = sorted(xs)
    if len(xs) < 4:
        m = statistics.median(xs)
        return xs[0], m, xs[-1]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[1], q[2]


@dataclass
class Ratio:
    """A vs B over interleaved rounds."""

    name_a: str
    name_b: str
    a: list[float]
    b: list[float]

    @property
    def median_a(self) -> float:
        return statistics.median(self.a)

    @property
    def median_b(self) -> float:
        return statistics.median(self.b)

    @property
    def ratio(self) -> float:
        """Ratio of medians, A / B."""
        return self.median_a / self.median_b

    @property
    def paired(self) -> list[float]:
        return [x / y for x, y in zip(self.a, self.b)]

    def line(self) -> str:
        q1, q2, q3 = quartiles(self.paired)
        qa, qb = quartiles(self.a), quartiles(self.b)
        return (f"{self.name_a}: median {self.median_a * 1e3:.1f} ms (IQR {qa[0] * 1e3:.1f}-{qa[2] * 1e3:.1f})   "
                f"{self.name_b}: median {self.median_b * 1e3:.1f} ms (IQR {qb[0] * 1e3:.1f}-{qb[2] * 1e3:.1f})\n"
                f"  ratio of medians {self.name_a}/{self.name_b} = {self.ratio:.3f}   "
                f"paired ratios: median {q2:.3f}, IQR {q1:.3f}-{q3:.3f}, "
                f"min {min(self.paired):.3f}, max {max(self.paired):.3f}  (n={len(self.a)})")

    def to_dict(self) -> dict:
        q1, q2, q3 = quartiles(self.paired)
        return {"a": self.name_a, "b": self.name_b, "median_a_ms": self.median_a * 1e3,
                "median_b_ms": self.median_b * 1e3, "ratio_of_medians": self.ratio,
                "paired_median": q2, "paired_q1": q1, "paired_q3": q3, "n": len(self.a)}


def check(label: str, value: float, target: float, le: bool = True) -> str:
    ok = value <= target if le else value >= target
    return f"{label}: {value:.3f} (target {'<=' if le else '>='} {target}) -> {'MET' if ok else 'MISSED'}"


def _result(queue, proc, deadline: float) -> dict | None:
    """The worker's result; an error dict at once when it exits without one (a crash, an OOM kill);
    None at the deadline."""
    while time.perf_counter() < deadline:
        try:
            return queue.get(timeout=min(5.0, max(0.1, deadline - time.perf_counter())))
        except Exception:  # noqa: BLE001 - queue.Empty: not yet
            if proc.exitcode is not None:
                try:
                    return queue.get(timeout=2.0)      # a result put just before it exited
                except Exception:  # noqa: BLE001
                    return {"error": f"the worker process exited with code {proc.exitcode} without a result "
                                     f"(negative: killed by that signal, e.g. -9 by the kernel's OOM killer)"}
    return None


def run_isolated(worker: Callable, args: tuple, hard_timeout: float, on_timeout: dict | None = None) -> dict:
    """``worker(*args, queue)`` in a fresh spawned process; its ``queue.put`` result, or
    ``{"error": "killed after ... (hard timeout)", **on_timeout}`` when nothing came within
    ``hard_timeout`` s (the process is then killed). ``"wall"``: seconds from start to result."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=worker, args=(*args, queue), daemon=True)
    t0 = time.perf_counter()
    proc.start()
    res = _result(queue, proc, t0 + hard_timeout)
    if res is None:
        res = {"error": f"killed after {hard_timeout:.0f} s (hard timeout)", **(on_timeout or {})}
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
    res["wall"] = time.perf_counter() - t0
    return res


def _call_worker(fn: Callable, args: tuple, queue) -> None:
    try:
        queue.put(fn(*args))
    except BaseException:  # noqa: BLE001 - the job's failure is its result
        import traceback

        queue.put({"error": traceback.format_exc(limit=3)})


def run_call_isolated(fn: Callable, args: tuple, hard_timeout: float, on_timeout: dict | None = None) -> dict:
    """``fn(*args)`` (a module-level function returning a dict) through :func:`run_isolated`; an
    exception becomes ``{"error": traceback}``."""
    return run_isolated(_call_worker, (fn, args), hard_timeout, on_timeout)


def run_fresh(module: str, func: str, kwargs: dict, timeout_s: float = 600) -> dict:
    """Run ``module.func(**kwargs)`` (returns a JSON-able dict) in a fresh Python process and
    add its wall time, CPU time (user + system: less sensitive than wall time to other load
    on the machine) and peak RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss``, MiB)."""
    code = (
        "import json, resource, sys, time\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        f"sys.path.insert(0, {os.path.join(ROOT, 'bench')!r})\n"
        f"import importlib; mod = importlib.import_module({module!r})\n"
        "t0 = time.perf_counter()\n"
        f"out = getattr(mod, {func!r})(**json.loads({json.dumps(json.dumps(kwargs))}))\n"
        "out['wall_s'] = time.perf_counter() - t0\n"
        "ru = resource.getrusage(resource.RUSAGE_SELF)\n"
        "out['peak_rss_mib'] = ru.ru_maxrss / 1024\n"
        "out['cpu_s'] = ru.ru_utime + ru.ru_stime\n"
        "print('@@RESULT@@' + json.dumps(out))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    for line in proc.stdout.splitlines():
        if line.startswith("@@RESULT@@"):
            return json.loads(line[len("@@RESULT@@"):])
    raise RuntimeError(f"{module}.{func} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


def gpt_of(cfg: dict):
    """The example GPT of a bench config (vocab, hidden, heads, layers, seq), seeded."""
    from examples.models import GPT

    torch.manual_seed(0)
    return GPT(vocab=cfg["vocab"], hidden=cfg["hidden"], heads=cfg["heads"], layers=cfg["layers"], seq=cfg["seq"])


def header(title: str) -> str:
    import datetime

    return (f"# {title}\n# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
            f"{os.cpu_count()} cores")
