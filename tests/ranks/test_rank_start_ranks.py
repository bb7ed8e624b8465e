"""A pool's ranks come from the fork server (``autopar.core.rank_start``), not from the pytest process, and see
the environment the parent had when the pool started, not the server's (started with an earlier pool)."""
from __future__ import annotations

import os
import time

import conftest
from autopar.runtime.launch import RankPool


def _seen(rank, name):
    return os.getppid(), os.environ.get(name), time.process_time()


def test_a_new_pools_ranks_are_forked_and_see_the_parents_environment_at_its_start(monkeypatch):
    conftest._pool(2)          # the fork server runs from here on (started with the suite's first pool)
    monkeypatch.setenv("AUTOPAR_RANK_START_MARK", "set after the server started")
    pool = RankPool(1, timeout_s=conftest.POOL_TIMEOUT_S)
    try:
        (parent, mark, cpu), = pool.run(_seen, "AUTOPAR_RANK_START_MARK", timeout_s=600)
    finally:
        pool.close()
    assert parent != os.getpid(), "the rank was started by the pytest process, not forked from the server"
    assert mark == "set after the server started"
    assert cpu < 2.0, f"the rank spent {cpu:.1f} CPU-s before its first job: it imported torch itself"
