"""Start N processes with the default process group initialized (gloo on CPU, nccl on GPU).

``launch(fn, nprocs)`` runs ``fn(rank, *args)`` once per rank; ``RankPool`` keeps the ranks
alive and runs many functions in them (tests and benchmarks share one pool).
Rendezvous uses a fresh ``file://`` path (no port race); each rank runs with one intra-op
thread and every process group has a timeout, so a dead rank fails the run instead of hanging.
"""
from __future__ import annotations

import datetime
import os
import queue
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.allocator import keep_freed_memory

DEFAULT_TIMEOUT_S = 120.0


class RankError(RuntimeError):
    """A rank raised; the message carries that rank's traceback."""


def rendezvous_file() -> str:
    """A fresh file:// rendezvous (no port to race for, unlike binding port 0 then releasing it)."""
    fd, path = tempfile.mkstemp(prefix="autopar_rdzv_")
    os.close(fd)
    os.unlink(path)
    return f"file://{path}"


def init_rank(rank: int, world: int, init_method: str, timeout_s: float = DEFAULT_TIMEOUT_S, threads: int = 1) -> None:
    """Initialize this process as ``rank`` of ``world`` (``file://`` or ``tcp://`` rendezvous)."""
    torch.set_num_threads(threads)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        keep_freed_memory()
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def init_from_env(timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Under torchrun (RANK/WORLD_SIZE/MASTER_ADDR set): initialize the default group (env://).

    Returns True when it initialized a group; False when one exists or the env has none.
    """
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    torch.set_num_threads(int(os.environ.get("AUTOPAR_THREADS", "1")))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        keep_freed_memory()
    dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout_s))
    return True


def _launch_entry(rank, fn, world, init_method, timeout_s, args, err_dir):
    init_rank(rank, world, init_method, timeout_s)
    try:
        try:
            fn(rank, *args)
        except BaseException:
            with open(os.path.join(err_dir, f"rank{rank}.txt"), "w") as f:
                f.write(traceback.format_exc())
            raise
        dist.barrier()  # a rank that finishes early must not tear down while others still connect
    finally:
        dist.destroy_process_group()


def launch(fn, nprocs: int = 4, args: tuple = (), timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` processes; raise ``RankError`` if any rank fails."""
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    with tempfile.TemporaryDirectory(prefix="autopar_launch_") as err_dir:
        try:
            mp.start_processes(_launch_entry, args=(fn, nprocs, rendezvous_file(), timeout_s, tuple(args), err_dir),
                               nprocs=nprocs, join=True, start_method="spawn")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
            own = sorted(f for f in os.listdir(err_dir) if f.endswith(".txt"))
            if own:  # the ranks whose function raised: the cause, not the peers that lost them
                detail = "".join(f"\n--- {f[:-4]} ---\n" + open(os.path.join(err_dir, f)).read() for f in own)
                raise RankError(f"{len(own)} rank(s) failed in {getattr(fn, '__name__', fn)}:{detail}") from None
            raise RankError(f"a rank failed:\n{err}") from None


# ---- a persistent pool of ranks ---------------------------------------------------------

def _pool_worker(rank, world, init_method, timeout_s, paths, inbox, outbox):
    sys.path[:0] = [p for p in paths if p not in sys.path]
    init_rank(rank, world, init_method, timeout_s)
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            outbox.put((rank, True, fn(rank, *args, **kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
            outbox.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """``nprocs`` spawned ranks that run ``fn(rank, *args)`` on request, process group kept."""

    def __init__(self, nprocs: int, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.nprocs, self.timeout_s = nprocs, timeout_s
        ctx = mp.get_context("spawn")
        self._inboxes = [ctx.Queue() for _ in range(nprocs)]
        self._outbox = ctx.Queue()
        rdzv = rendezvous_file()
        self._procs = [ctx.Process(target=_pool_worker, daemon=True,
                                   args=(r, nprocs, rdzv, timeout_s, list(sys.path), self._inboxes[r], self._outbox))
                       for r in range(nprocs)]
        for p in self._procs:
            p.start()
        self.broken = False

    def run(self, fn, *args, timeout_s: float | None = None, **kwargs) -> list:
        """Run on every rank; return the per-rank results (rank order) or raise RankError."""
        if self.broken:
            raise RankError("this RankPool is broken by an earlier failure; make a new one")
        for box in self._inboxes:
            box.put((fn, args, kwargs))
        results, errors = {}, {}
        limit = timeout_s or self.timeout_s + 30
        try:
            for _ in range(self.nprocs):
                rank, ok, value = self._outbox.get(timeout=limit)
                (results if ok else errors)[rank] = value
                if errors:
                    limit = min(limit, self.timeout_s + 10)
        except queue.Empty:
            self.broken = True
            missing = sorted(set(range(self.nprocs)) - set(results) - set(errors))
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise RankError(f"ranks {missing} did not finish {getattr(fn, '__name__', fn)} in {limit:.0f}s{detail}") from None
        if errors:
            self.broken = True
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise RankError(f"{len(errors)} rank(s) failed in {getattr(fn, '__name__', fn)}:{detail}")
        return [results[r] for r in range(self.nprocs)]

    def close(self) -> None:
        for box in self._inboxes:
            try:
                box.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self._procs:
            p.join(timeout=5 if not self.broken else 0.1)
            if p.is_alive():
                p.kill()
