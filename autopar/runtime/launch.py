"""Start N processes with the default process group initialized (gloo on CPU, nccl on GPU).

``launch(fn, nprocs)`` runs ``fn(rank, *args)`` once per rank; ``RankPool`` keeps the ranks
alive and runs many functions in them (tests and benchmarks share one pool).
Rendezvous uses a fresh ``file://`` path (no port race); each rank runs with one intra-op
thread and every process group has a timeout, so a dead rank fails the run instead of hanging.

When a rank fails, ``launch`` gives the others time to fail on their own (their peer died or
stalled: ``CommError``; ``_settle``), asks any rank still running for its Python stack
(``faulthandler`` on SIGUSR1: a stalled rank says where it is), ends the rest, and raises one
``RankError`` with the cause first (``rank_failure.describe``).
"""
from __future__ import annotations

import atexit
import datetime
import multiprocessing.connection
import os
import queue
import signal
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.core.allocator import keep_freed_memory
from autopar.collectives.watch import guard, note
from autopar.core.comm_timeout import DEFAULT_TIMEOUT_S, comm_timeout_s
from autopar.core import rank_start
from autopar.runtime import rank_failure
_GRACE_S = 2.0      # after a rank fails, how long the others may take to fail on their own (and say why)
_POLL_S = 0.05      # how often launch looks for a rank's recorded error while all are running
_MIN_SETTLE_S = 0.5     # with no cause known, the least time before the one rank left running is called stalled


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


def init_from_env(timeout_s: float | None = None) -> bool:
    """Under torchrun (RANK/WORLD_SIZE/MASTER_ADDR set): initialize the default group (env://) with
    ``timeout_s`` (default: the communication timeout in force: ``parallelize``'s or the context's
    ``comm_timeout_s``, else ``DEFAULT_TIMEOUT_S``).

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
    seconds = timeout_s if timeout_s is not None else comm_timeout_s()
    dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=seconds))
    atexit.register(_destroy_at_exit)
    return True


def _destroy_at_exit() -> None:
    """Shut the group ``init_from_env`` made down before the interpreter exits: left to static
    destruction, gloo's threads could abort a rank that had trained ("terminate called without an
    active exception", exit -6, in ~1 of 3 torchrun runs of tests/ranks/test_launch.py)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _launch_entry(rank, fn, world, init_method, timeout_s, args, err_dir, env=None):
    if env is not None:
        rank_start.apply_env(env)
    rank_failure.dump_stack_on_request(err_dir, rank)
    try:
        try:
            init_rank(rank, world, init_method, timeout_s)
            fn(rank, *args)
            with guard(f"autopar.launch (rank {rank} returned from {getattr(fn, '__name__', fn)})", timeout_s):
                note("barrier", detail="where every rank waits for the others to return")
                dist.barrier()  # a rank that finishes early must not tear down while others still connect
        except BaseException:
            rank_failure.record(err_dir, rank)
            raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn, nprocs: int = 4, args: tuple = (), timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` processes; raise ``RankError`` if any rank fails, the
    failing rank's own error first (``rank_failure.describe``). ``timeout_s``: the default process
    group's timeout, which autopar's communication timeout follows unless ``comm_timeout_s`` is set."""
    name = f"autopar.launch({getattr(fn, '__name__', fn)})"
    if rank_failure.bootstrapping():    # a spawned rank re-running the script's top level: no main guard
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rank_failure.NO_MAIN_GUARD_EXIT)     # the code itself (a fork server's child exits 1 on SystemExit)
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"{name}: nprocs must be a whole number >= 1, got {nprocs!r}")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(sys.modules["__main__"], "__file__", None):
        raise RankError(f"{name}: {getattr(fn, '__name__', fn)} is defined in an interactive session, which the "
                        "spawned processes cannot import; define it in a module file and import it")
    with tempfile.TemporaryDirectory(prefix="autopar_launch_") as err_dir:
        ctx = mp.start_processes(_launch_entry, args=(fn, nprocs, rendezvous_file(), timeout_s, tuple(args), err_dir,
                                                      dict(os.environ)),
                                 nprocs=nprocs, join=False, start_method=rank_start.start_method())
        procs = ctx.processes
        try:
            if _wait_first_failure(procs, err_dir):
                raise RankError(_launch_failure(name, procs, err_dir, timeout_s))
        finally:
            _end(procs)


def _wait_first_failure(procs, err_dir: str) -> bool:
    """Wait until every process has ended (False) or one has failed (True): it died, or it recorded an
    error (noticed before its exit, which takes a second or more: the interpreter tears torch down)."""
    while True:
        running = [p for p in procs if p.exitcode is None]
        if any(p.exitcode for p in procs) or rank_failure.any_recorded(err_dir):
            return True
        if not running:
            return False
        multiprocessing.connection.wait([p.sentinel for p in running], timeout=_POLL_S)


def _join_all(procs, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))


def _end(procs) -> None:
    """SIGTERM the processes still running, then SIGKILL those that ignore it."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    _join_all(procs, _GRACE_S)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()


def _settle(procs, err_dir: str, timeout_s: float) -> float:
    """After the first failure, give the other ranks time to fail on their own; the seconds waited.

    With a cause known (a rank died, or raised an error other than a lost peer) that is ``_GRACE_S``.
    Otherwise every error so far is a lost or timed-out peer, and the rank that stalled is the one
    left running once all the others have failed, which can take up to one more communication
    timeout (a rank may be waiting on a rank that already failed but has not exited yet): wait until
    one rank is left (at least ``_MIN_SETTLE_S``), or that timeout (a CommError's, else the default
    group's) and ``_GRACE_S`` have passed."""
    start = time.monotonic()
    while True:
        failures = rank_failure.recorded(err_dir)
        raised = {f.rank for f in failures}
        running = [p for i, p in enumerate(procs) if p.exitcode is None and i not in raised]
        caused = any(p.exitcode and i not in raised for i, p in enumerate(procs)) or any(
            not f.lost_peer for f in failures)
        waited = time.monotonic() - start
        limit = _GRACE_S + (0.0 if caused else max([f.timeout_s for f in failures if f.timeout_s] or [timeout_s]))
        if not running or waited >= limit or (not caused and len(running) == 1 and waited >= _MIN_SETTLE_S):
            return waited
        multiprocessing.connection.wait([p.sentinel for p in running], timeout=_POLL_S)


def _launch_failure(name: str, procs, err_dir: str, timeout_s: float) -> str:
    """The RankError text, once the others have had time to fail on their own (``_settle``): deaths
    (signal, exit code), raised errors, and ranks still running (with their stacks), the cause first."""
    waited = _settle(procs, err_dir, timeout_s)
    failures = rank_failure.recorded(err_dir)
    raised = {f.rank for f in failures}
    running = [i for i, p in enumerate(procs) if p.is_alive() and i not in raised]
    stacks = rank_failure.request_stacks(err_dir, {i: procs[i].pid for i in running})
    asked = {i: -(rank_failure.STACK_SIGNAL or 0) for i in stacks}     # a rank exiting as it was asked: not a death
    deaths = {i: p.exitcode for i, p in enumerate(procs)
              if i not in raised and p.exitcode and p.exitcode != asked.get(i)}
    if rank_failure.NO_MAIN_GUARD_EXIT in deaths.values():
        return rank_failure.no_main_guard_message(name)
    return rank_failure.describe(name, failures, deaths, stacks, waited)


# ---- a persistent pool of ranks ---------------------------------------------------------

def _pool_worker(rank, world, init_method, timeout_s, paths, inbox, outbox, env=None):
    sys.path[:0] = [p for p in paths if p not in sys.path]
    if env is not None:
        rank_start.apply_env(env)
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
    outbox.close()
    outbox.join_thread()    # every result sent; then exit without the interpreter's teardown (~0.6 CPU-s a rank)
    os._exit(0)


class RankPool:
    """``nprocs`` spawned ranks that run ``fn(rank, *args)`` on request, process group kept."""

    def __init__(self, nprocs: int, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.nprocs, self.timeout_s = nprocs, timeout_s
        ctx = rank_start.pool_context()
        self._inboxes = [ctx.Queue() for _ in range(nprocs)]
        self._outbox = ctx.Queue()
        rdzv = rendezvous_file()
        self._procs = [ctx.Process(target=_pool_worker, daemon=True,
                                   args=(r, nprocs, rdzv, timeout_s, list(sys.path), self._inboxes[r], self._outbox,
                                         dict(os.environ)))
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
        results, errors = {}, []
        limit = timeout_s or self.timeout_s + 30
        name = getattr(fn, "__name__", fn)
        try:
            for _ in range(self.nprocs):
                rank, ok, value = self._outbox.get(timeout=limit)
                if ok:
                    results[rank] = value
                else:       # arrival order stands in for time: the cause is usually first
                    errors.append(rank_failure.Failure(rank, len(errors), value))
                    limit = min(limit, self.timeout_s + 10)
        except queue.Empty:
            self.broken = True
            missing = sorted(set(range(self.nprocs)) - set(results) - {f.rank for f in errors})
            deaths = {r: self._procs[r].exitcode for r in missing if self._procs[r].exitcode}
            raise RankError(f"ranks {missing} did not finish {name} in {limit:.0f}s\n"
                            + rank_failure.describe(name, errors, deaths)) from None
        if errors:
            self.broken = True
            raise RankError(rank_failure.describe(name, errors))
        return [results[r] for r in range(self.nprocs)]

    def stop(self) -> None:
        """Ask every rank to exit, without waiting (``close`` waits): pools stopped together exit together."""
        if getattr(self, "_stopped", False):
            return
        self._stopped = True
        for box in self._inboxes:
            try:
                box.put(None)
            except Exception:  # noqa: BLE001
                pass

    def close(self) -> None:
        self.stop()
        for p in self._procs:
            p.join(timeout=5 if not self.broken else 0.1)
            if p.is_alive():
                p.kill()
