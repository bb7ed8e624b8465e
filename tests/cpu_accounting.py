"""Where the suite's CPU goes (diagnostics; off unless asked for by environment variable).

``AUTOPAR_RANK_TIMES=PREFIX``: every rank appends, per test function it runs, its CPU seconds and those
spent in ``trace``, ``make_plans`` and ``build_parallel_module`` to ``PREFIX.<rank>``; with
``AUTOPAR_TEST_TIMES`` set too, each test's line there gains the pytest process's own CPU seconds
(``main=``) and its reaped subprocesses' (``kids=``: torchrun and other subprocess tests; the pool's and
``launch``'s ranks are forked from the fork server, which reaps them and is reaped at the session's end). ``AUTOPAR_RANK_PROFILE=DIR``: a CPU-clock cProfile of every rank's call, one file each.
"""
from __future__ import annotations

import os
import resource
import time

_CPU = [0.0, 0.0]
_TIMED = ("trace", "make_plans", "build_parallel_module")


def cpu_note() -> str:
    """This process's CPU seconds and its reaped subprocesses' since the last call ("" when off)."""
    if not os.environ.get("AUTOPAR_RANK_TIMES"):
        return ""
    own, kids = time.process_time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    kids = kids.ru_utime + kids.ru_stime
    note = f"\tmain={own - _CPU[0]:.2f}\tkids={kids - _CPU[1]:.2f}"
    _CPU[:] = [own, kids]
    return note


def _timed(acc: dict, name: str, f):
    def call(*args, **kwargs):
        start = time.process_time()
        try:
            return f(*args, **kwargs)
        finally:
            acc[name] = acc.get(name, 0.0) + time.process_time() - start
    return call


def _times(prefix: str, rank: int, fn, *args, **kwargs):
    from autopar import api

    acc: dict = {}
    saved = {n: getattr(api, n) for n in _TIMED}
    for n, f in saved.items():
        setattr(api, n, _timed(acc, n, f))
    start = time.process_time()
    try:
        return fn(rank, *args, **kwargs)
    finally:
        for n, f in saved.items():
            setattr(api, n, f)
        with open(f"{prefix}.{rank}", "a") as out:
            parts = [getattr(fn, "__name__", "fn"), f"{time.process_time() - start:.2f}"]
            out.write("\t".join(parts + [f"{n}={v:.2f}" for n, v in acc.items()]) + "\n")


def _profiled(out_dir: str, rank: int, fn, *args, **kwargs):
    import cProfile

    prof = cProfile.Profile(time.process_time)
    try:
        return prof.runcall(fn, rank, *args, **kwargs)
    finally:
        prof.dump_stats(os.path.join(out_dir, f"{getattr(fn, '__name__', 'fn')}_{rank}_{time.time_ns()}.prof"))


def call(rank: int, fn, *args, **kwargs):
    """``fn(rank, *args, **kwargs)``, accounted for as the environment asks."""
    if os.environ.get("AUTOPAR_RANK_TIMES"):
        return _times(os.environ["AUTOPAR_RANK_TIMES"], rank, fn, *args, **kwargs)
    if os.environ.get("AUTOPAR_RANK_PROFILE"):
        return _profiled(os.environ["AUTOPAR_RANK_PROFILE"], rank, fn, *args, **kwargs)
    return fn(rank, *args, **kwargs)
