"""The feature matrix: one model with sliced, tied, frozen and unused parameters, an integer buffer
updated in place, BatchNorm and a custom autograd Function (``semantics_models.Kitchen``), trained with gradient accumulation
over 3 micro-steps and gradient clipping, through every plan kind: DATA, TP, PP, a 3-D plan, and
AUTO with the measured choice off and on. Each run goes through the oracle with SGD+momentum
(gradients before every step and parameters after it at 1e-5), so a gradient-scale error fails."""
from __future__ import annotations

import pytest

import autopar
from autopar import Shard
from conftest import run_ranks
from oracle import assert_same_training, parallel_run, reference_run
from semantics_models import Kitchen, token_loss, tokens

DEVICE = "a100-80gb"
MICRO, CLIP, BATCH = 3, 0.5, 24


def _tp(model):
    autopar.shard("blocks.*.fc1", weight={"tp": Shard(0)})
    autopar.shard("blocks.*.fc2", weight={"tp": Shard(1)})


PLANS = {          # name: (ranks, mesh shape, axis names, mode, annotate, autotune_top_k)
    "data": (4, (4,), None, "data", None, 0),
    "tp": (2, (2,), ("tp",), "semi_auto", _tp, 0),
    "pp": (2, (2,), ("pp",), "auto", None, 0),
    "3d": (8, (2, 2, 2), ("pp", "dp", "tp"), "semi_auto", _tp, 0),
    "auto": (4, (4,), None, "auto", None, 0),
    "auto_tuned": (4, (4,), None, "auto", None, 3),
}


def _job(rank, name):
    _, shape, names, mode, annotate, top_k = PLANS[name]
    if top_k:
        autopar.set_auto_parallel_context(autotune_top_k=top_k, autotune_steps=1, autotune_slack=100.0)
    x, y = tokens(BATCH)
    mesh = autopar.Mesh(shape, axis_names=names, device=DEVICE)
    return parallel_run(rank, Kitchen, token_loss, x, y, mesh, mode, setup=annotate, micro=MICRO, clip=CLIP)


# 3-D on 8 ranks is slow here: tests/ranks/test_pipeline.py::test_3d_pp_dp_tp_on_8_ranks trains pp x dp x tp
# in the default run
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "3d" else n for n in PLANS])
def test_feature_matrix_trains_like_one_device(name):
    x, y = tokens(BATCH)
    ref = reference_run(Kitchen, token_loss, x, y, micro=MICRO, clip=CLIP)
    assert all(n > CLIP for n in ref["norms"]), "clipping must be active for the test to see it"
    results = run_ranks(PLANS[name][0], _job, name)
    for r in results:
        assert_same_training(ref, r, what=f"kitchen {name}")
    plan = autopar.Plan.from_json(results[0]["plan"])
    if name in ("pp", "3d"):
        assert plan.degrees["pp"] == 2, plan.degrees
    if name in ("tp", "3d"):
        tp = plan.mesh.axis_index("tp")
        assert isinstance(plan.params["blocks.0.fc1.weight"].spec[tp], autopar.Shard), plan.params["blocks.0.fc1.weight"]
    frozen = plan.params["blocks.0.frozen.weight"]
    assert not frozen.trainable and frozen.grad_sync == []
    assert not plan.params["blocks.0.unused.weight"].trainable
