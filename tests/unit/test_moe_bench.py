"""bench/moe_table.py (``bench/paper_table.py --table moe``) on a shrunken Mixtral row: the forced
published layout (a named ("pp", "dp", "ep") mesh) is what the plan runs, and the row's TFLOP/s is
the source's FLOP count over the predicted step. Planning only."""
from __future__ import annotations

import dataclasses

import pytest

from bench.moe_table import MOE_ROWS, megatron_flops, plan_row, result, step_flops

SMALL = dataclasses.replace(
    MOE_ROWS[0], name="mixtral_small", gpus=8, mesh=(2, 2, 2), seq=64, batch=16,
    config=dict(MOE_ROWS[0].config, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, vocab_size=256),
    extra={})       # two layers: no room for the row's 8 virtual stages per pipeline rank


def test_megatron_flops_counts_top_k_gated_experts():
    cfg = SMALL.config
    one = megatron_flops({**cfg, "num_experts_per_tok": 1}, 1, 64)
    two = megatron_flops(cfg, 1, 64)
    h, L, f = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    # each routed expert adds 3 GEMMs of h x f per token, x2 FLOPs, x3 (forward, dgrad, wgrad)
    assert two - one == pytest.approx(18 * 64 * L * h * f)
    assert step_flops(SMALL) == megatron_flops(cfg, SMALL.batch, SMALL.seq)


@pytest.mark.slow
def test_forced_row_is_the_published_layout():
    """(slow: a pipelined plan on 8 GPUs; tests/test_moe_plan.py plans named ep meshes fast)"""
    plan, _ = plan_row(SMALL, forced=True, time_budget=None)
    assert plan.mesh.axis_names == ("pp", "dp", "ep")
    # on this tiny stand-in the planner may also split the experts over dp ("experts": tokens whole, each rank
    # launching a quarter of the experts' kernels, predicted ~3 % faster); the full rows keep dp data-parallel
    assert plan.degrees["pp"] == 2 and plan.degrees["ep"] in (2, 4), plan.degrees
    assert plan.memory_options.mixed_precision == "bf16"
    moe = [d for d in plan.nodes.values() if d.op.startswith("autopar.moe_experts")]
    assert moe and all(d.local[plan.mesh.axis_index("ep")] == "moe:ep" for d in moe)
    r = result(SMALL, forced=True, time_budget=None)
    assert "error" not in r, r.get("error")
    assert r["tflops"] == pytest.approx(step_flops(SMALL) / r["step"] / SMALL.gpus / 1e12)
    assert r["ratio"] == pytest.approx(r["tflops"] / SMALL.tflops) and f"ep={plan.degrees['ep']}" in r["degrees"]
