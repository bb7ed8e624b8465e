"""Gradient accumulation as a plan choice (``plan.memory_options.accumulation``): the global batch
runs as k microbatches one after another inside ``pmodel.step``, gradients synced once. AUTO picks
the smallest k that fits the memory cap; a user can fix k (``set_auto_parallel_context(accumulation=k)``)."""
from __future__ import annotations

import pytest

import autopar
from conftest import run_ranks
from examples.models import lm_loss
from oracle import assert_same_training, make_batch, parallel_run, reference_run
from accumulation_jobs import BATCH, MODEL, _capped_mesh


def _job(rank, name, micro):
    x, y = make_batch("tokens", BATCH)
    if name == "auto":
        mesh = _capped_mesh()
        autopar.set_auto_parallel_context(recompute="none", zero=0)    # ZeRO with accumulation: test_zero.py
    else:
        autopar.set_auto_parallel_context(accumulation=4 if name == "data" else 2)
        mesh = autopar.Mesh(2, axis_names=("tp",)) if name == "tp" else autopar.Mesh(2)
        if name == "tp":
            autopar.shard("blocks.*.fc1", weight={"tp": autopar.Shard(0)})
            autopar.shard("blocks.*.fc2", weight={"tp": autopar.Shard(1)})
    mode = {"auto": "auto", "data": "data", "tp": "semi_auto"}[name]
    return parallel_run(rank, MODEL, lm_loss, x, y, mesh, mode, micro=micro, clip=0.5 if micro > 1 else None)


@pytest.mark.parametrize("name,micro", [("auto", 1), ("data", 2), ("tp", 1)])
def test_accumulation_plans_train_like_one_device(name, micro):
    """``micro``: the user also accumulates over several step() calls on top of the plan's own."""
    x, y = make_batch("tokens", BATCH)
    ref = reference_run(MODEL, lm_loss, x, y, micro=micro, clip=0.5 if micro > 1 else None)
    for r in run_ranks(2, _job, name, micro):
        plan = autopar.Plan.from_json(r["plan"])
        assert plan.memory_options.accumulation > 1, plan.memory_options
        assert_same_training(ref, r, 1e-5, f"{name} accumulation {plan.memory_options.accumulation}")
