"""``bench.common.run_isolated``: a worker that dies without a result is reported at once, not after the
hard timeout (a planning job killed by the kernel's OOM killer used to hold a table for its whole limit)."""
from __future__ import annotations

import os
import time

from bench import common


def _dies(queue):
    os._exit(3)


def _answers(queue):
    queue.put({"answer": 42})


def test_a_worker_that_exits_without_a_result_is_an_error_at_once():
    start = time.perf_counter()
    res = common.run_isolated(_dies, (), hard_timeout=300)
    assert time.perf_counter() - start < 60
    assert "exited with code 3 without a result" in res["error"]


def test_a_worker_that_answers_gives_its_result():
    res = common.run_isolated(_answers, (), hard_timeout=300)
    assert res["answer"] == 42 and res["wall"] > 0
