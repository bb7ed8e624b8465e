"""Ranks started with different jobs (model, example inputs, mesh) end with one clear error on every
rank, naming the rank and the field, not a hang or silently different training (issue 15, part 3)."""
from __future__ import annotations

import re
import time

import pytest
import torch

import autopar
from autopar.core.errors import RankMismatchError
from conftest import POOL_TIMEOUT_S, run_ranks
from examples.models import GPT, lm_loss


def _start(rank, what):
    hidden = 48 if what == "model" and rank == 1 else 32
    batch = 6 if what == "inputs" and rank == 1 else 4
    torch.manual_seed(0)
    model = GPT(vocab=64, hidden=hidden, heads=4, layers=1, seq=8)
    x = torch.randint(0, 64, (batch, 8))
    mesh = autopar.Mesh(2, axis_names=("tp",) if what == "mesh" and rank == 1 else None)
    t0 = time.perf_counter()
    try:
        autopar.parallelize(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=x, mode="data")
    except RankMismatchError as err:
        return str(err), time.perf_counter() - t0
    return None, time.perf_counter() - t0


@pytest.mark.parametrize("what,field,detail", [
    ("model", "model", r"entry 0: 'wte.weight \[64, 32\] torch.float32' on rank 0, 'wte.weight \[64, 48\]"),
    ("inputs", "example inputs", r"\[4, 8\] torch.int64.*on rank 0, .*\[6, 8\] torch.int64.* on rank 1"),
    ("mesh", "mesh", r"Mesh\(d0=2.*on rank 0, .*Mesh\(tp=2.*on rank 1"),
])
def test_ranks_started_differently_fail_together_naming_rank_and_field(what, field, detail):
    results = run_ranks(2, _start, what)
    for message, seconds in results:
        assert message is not None, "a mismatched rank went on"
        assert f"ranks disagree at start-up: rank 1's {field} differs from rank 0's" in message
        assert "Every rank must run the same script" in message
        assert re.search(detail, message), message
        assert seconds < POOL_TIMEOUT_S / 3     # failed at the check, not at a timeout (a bound that holds at load 10)


def test_ranks_started_alike_agree():
    for message, _ in run_ranks(2, _start, "nothing"):
        assert message is None


def _given_plan(rank):
    torch.manual_seed(0)
    model = GPT(vocab=64, hidden=32, heads=4, layers=1, seq=8)
    x = torch.randint(0, 64, (4, 8))
    mesh = autopar.Mesh(2)
    plan = autopar.plan(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=x,
                        mode="data" if rank == 0 else "stand_alone")
    try:
        autopar.parallelize(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=x, plan=plan)
    except RankMismatchError as err:
        return str(err)
    return None


def test_ranks_given_different_plans_fail_naming_the_plan():
    """Plans each rank made for itself agree when their decisions do (solve times differ): this one
    differs in mode and layouts."""
    for message in run_ranks(2, _given_plan):
        assert message is not None and "rank 1's given plan differs from rank 0's" in message, message
