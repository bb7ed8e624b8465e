"""Shared multi-rank harness: one spawned process group per world size, reused by every test.

``run_ranks(n, fn, *args)`` runs ``fn(rank, *args)`` on n ranks (gloo, 1 thread each, a
timeout on every process group) and returns the per-rank results. A pool that saw a
failure is replaced before the next test uses it.

AUTO's measured choice (``autotune_top_k``, on by default) is off in the suite unless
``AUTOPAR_AUTOTUNE_TOP_K`` is set: a timed choice would make the plan a test sees depend on the
machine's load. ``test_autotune.py`` turns it on where it is the thing tested.
"""
from __future__ import annotations

import os

os.environ.setdefault("AUTOPAR_AUTOTUNE_TOP_K", "0")

import pytest  # noqa: E402

import cpu_accounting  # noqa: E402

from autopar.runtime.launch import RankPool  # noqa: E402

_POOLS: dict[int, RankPool] = {}
POOL_TIMEOUT_S = 90     # every process group of the pool times out after this


def _pool(n: int) -> RankPool:
    pool = _POOLS.get(n)
    if pool is None or pool.broken:
        if pool is not None:
            pool.close()
        pool = _POOLS[n] = RankPool(n, timeout_s=POOL_TIMEOUT_S)
    return pool


def pytest_runtest_logreport(report):
    """``AUTOPAR_TEST_TIMES=FILE``: append each test's call seconds to FILE as it ends (a run
    stopped half-way still says where its time went; ``--durations`` reports only at the end)."""
    path = os.environ.get("AUTOPAR_TEST_TIMES")
    if path and report.when == "call":
        with open(path, "a") as f:
            f.write(f"{report.duration:.2f}\t{report.outcome}\t{report.nodeid}{cpu_accounting.cpu_note()}\n")


def _fresh_call(rank, fn, *args, **kwargs):
    """Ranks outlive tests: start every test function from a clean autopar context."""
    import autopar

    autopar.reset_auto_parallel_context()
    autopar.clear_annotations()
    return cpu_accounting.call(rank, fn, *args, **kwargs)


def run_ranks(n: int, fn, *args, **kwargs) -> list:
    return _pool(n).run(_fresh_call, fn, *args, **kwargs)


@pytest.fixture(scope="session", autouse=True)
def _close_pools():
    yield
    for pool in _POOLS.values():
        pool.stop()
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
    from autopar.core.rank_start import stop_server

    stop_server()    # the pools' fork server, reaped: its CPU is counted


@pytest.fixture(autouse=True)
def _fresh_context():
    import autopar

    autopar.reset_auto_parallel_context()
    autopar.clear_annotations()
    yield
    autopar.reset_auto_parallel_context()
    autopar.clear_annotations()
