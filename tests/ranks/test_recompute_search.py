"""Recomputation as a plan choice (``plan.memory_options.recompute``): AUTO/SEMI_AUTO try "none",
then "selective", then "full" at each accumulation k while nothing fits the memory cap; a user can
fix it (``set_auto_parallel_context(recompute=...)``)."""
from __future__ import annotations

import torch

import autopar
from conftest import run_ranks
from examples.models import lm_loss
from oracle import assert_same_training, make_batch, parallel_run, reference_run
from recompute_search_jobs import BATCH, MODEL, PIPE_MODEL, _capped_mesh, _pipe_cap_gb, _pipe_capped_mesh


def _job(rank, cap_gb):
    x, y = make_batch("tokens", BATCH)
    mesh = autopar.Mesh(2, axis_names=("dp",), memory_gb=cap_gb)      # ``_capped_mesh(0.65)``, probed once
    return parallel_run(rank, MODEL, lm_loss, x, y, mesh, "auto", steps=2)


def test_auto_picked_recomputation_trains_like_one_device():
    x, y = make_batch("tokens", BATCH)
    ref = reference_run(MODEL, lm_loss, x, y, steps=2)
    for r in run_ranks(2, _job, _capped_mesh(0.65).memory_gb):
        plan = autopar.Plan.from_json(r["plan"])
        assert plan.memory_options.recompute != "none", plan.memory_options
        assert_same_training(ref, r, what=f"auto {plan.memory_options.summary()}")


def _pipe_job(rank, cap_gb):
    x = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))
    return parallel_run(rank, PIPE_MODEL, lm_loss, x, x, _pipe_capped_mesh(cap_gb), "auto", steps=2)


def test_auto_recomputed_pipeline_trains_like_one_device():
    x = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))
    ref = reference_run(PIPE_MODEL, lm_loss, x, x, steps=2)
    for r in run_ranks(2, _pipe_job, _pipe_cap_gb()):
        plan = autopar.Plan.from_json(r["plan"])
        assert plan.degrees["pp"] == 2 and plan.memory_options.recompute != "none", plan.memory_options
        assert_same_training(ref, r, what=f"pipeline {plan.memory_options.summary()}")
