"""The router's load-balancing loss trains on 4 ranks as on one process, where DDP's does not.

Hugging Face MoE models with ``output_router_logits=True`` add ``router_aux_loss_coef * aux`` to the
loss (the model's ``.loss`` with labels), ``aux`` being num_experts x the sum over experts of (the
fraction of tokens routed to the expert) x (its mean router probability): a product of two batch
means. DDP computes it from each rank's rows and averages the gradients, which is not the gradient of
the whole batch's product; autopar traces the whole batch's step, so its means are global (the
reductions over split rows all-reduce). Measured here on one job: autopar DATA and AUTO equal one
process at 1e-5 (SGD with momentum, gathered gradients, 2 steps), and DDP lands far from it.
"""
from __future__ import annotations

import pytest

import autopar
from conftest import _fresh_call, _pool
from oracle import assert_same_training, distance, parallel_run, reference_run
from torch_baseline import torch_dp_run

pytest.importorskip("transformers")

from examples.hf_moe_zoo import moe_model  # noqa: E402

RANK_LIMIT_S = 900     # 4 ranks each tracing and planning a MoE model on a shared 2-core machine
WORLD, STEPS = 4, 2
DDP_GAP = 1e-3      # DDP's distance from one process must exceed this (100x the oracle's 1e-5)


def _build(name):
    zm = moe_model(name, aux=True)
    return (lambda: moe_model(name, aux=True).module), zm.loss_fn, zm.inputs[0][0], zm.target


def _job(rank, name, modes):
    make, loss_fn, x, y = _build(name)
    out = {mode: parallel_run(rank, make, loss_fn, x, y, autopar.Mesh(WORLD), mode, steps=STEPS) for mode in modes}
    out["ddp"] = torch_dp_run(rank, make, loss_fn, x, y, steps=STEPS)
    return out


def _check(name, modes):
    make, loss_fn, x, y = _build(name)
    ref = reference_run(make, loss_fn, x, y, steps=STEPS)
    results = _pool(WORLD).run(_fresh_call, _job, name, modes, timeout_s=RANK_LIMIT_S)
    for r, res in enumerate(results):
        for mode in modes:
            assert_same_training(ref, res[mode], what=f"{name} aux loss {mode} rank {r}")
    gap = distance(results[0]["ddp"], ref)
    print(f"{name}: DDP's distance from one process {gap:.3e}")
    assert gap > DDP_GAP, f"{name}: DDP is only {gap:.2e} from one process; the test does not tell the two apart"
    return gap


def test_mixtral_aux_loss_is_global_in_data_parallel():
    _check("mixtral", ("data",))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_aux_loss_is_global_in_data_and_auto(name):
    _check(name, ("data", "auto"))


def test_families_without_an_aux_loss_are_a_clear_error():
    with pytest.raises(ValueError, match=r"deepseek_v3 has no router load-balancing loss"):
        moe_model("deepseek_v3", aux=True)
    with pytest.raises(ValueError, match=r"unknown MoE zoo model 'mixtral2': choose one of mixtral"):
        moe_model("mixtral2")
