"""Expert tensor parallelism (``sharding/rules/moe.py``'s "etp": each expert's FFN split like a Megatron
MLP, output Partial), alone and folded with expert parallelism on another axis (ep x etp), trained
exactly like one device (the oracle: losses, gathered gradients, SGD-momentum parameters at 1e-5)."""
from __future__ import annotations

import pytest

import autopar
from conftest import _fresh_call, _pool
from moe_models import batch, lm_loss, moe_lm
from oracle import assert_same_training, parallel_run, reference_run
from ranks.test_moe_exact import _moe_nodes, _roles, experts_modules

pytest.importorskip("transformers")

STEPS = 2
CASES = {   # name: (ranks, mesh shape, axis names, per-axis experts strategy, expected roles)
    "etp2": (2, (2,), ("tp",), {"tp": "etp"}, {("tp", "etp")}),
    "ep2_etp2": (4, (2, 2), ("dp", "tp"), {"dp": "ep", "tp": "etp"}, {("dp", "ep"), ("tp", "etp")}),
}


def _job(rank, name, family):
    _, shape, names, strategy, _ = CASES[name]
    x, y = batch()

    def setup(model):
        for path in experts_modules(model):
            autopar.op_strategy(path, **strategy)

    mesh = autopar.Mesh(shape, axis_names=names)
    return parallel_run(rank, lambda: moe_lm(family), lm_loss, x, y, mesh, "semi_auto", steps=STEPS, setup=setup)


def _run(name, family):
    n = CASES[name][0]
    results = _pool(n).run(_fresh_call, _job, name, family, timeout_s=600)
    x, y = batch()
    ref = reference_run(lambda: moe_lm(family), lm_loss, x, y, steps=STEPS)
    for r in results:
        assert_same_training(ref, r, what=f"{family} {name}")
    plan = autopar.Plan.from_json(results[0]["plan"])
    assert len(_moe_nodes(plan)) == 2, "each layer's experts must be one autopar::moe_experts node"
    assert _roles(plan) == CASES[name][4], _roles(plan)
    return plan


def test_expert_tensor_parallel_trains_like_one_device():
    _run("etp2", "mixtral")


@pytest.mark.slow
@pytest.mark.parametrize("name,family", [("ep2_etp2", "mixtral"), ("etp2", "gpt_oss"), ("etp2", "qwen2_moe")])
def test_expert_tensor_parallel_folded_and_families(name, family):
    _run(name, family)
