"""bench/llama3_table.py (``bench/paper_table.py --table llama3``): the FLOP count against a hand
computation and the model's own weights, the Table 4 rows as published, the ``--scale`` shrink, and
(slow) the forced published layout on a shrunken 128K row: a named ("pp", "dp", "cp", "tp") mesh."""
from __future__ import annotations

import dataclasses

import pytest

from bench.llama3_table import ROWS, LlamaRow, build, flops_per_token, forced_mismatches, plan_row, scaled, step_flops

TINY = LlamaRow("tiny", gpus=16, tp=2, cp=2, pp=2, dp=2, seq=4, batch=6, tflops=1.0, mfu=0.1, layers=2, hidden=8,
                ffn=16, heads=2, kv_heads=1, vocab=10)


def test_flops_per_token_by_hand():
    # head dim 4, one key/value head: q, o 8x8; k, v 8x4; gate, up, down 8x16; output layer 10x8
    weights = 2 * (2 * 64 + 2 * 32 + 3 * 128) + 80        # 1232 multiply-adds per token
    # forward FLOPs per token and layer: QK^T 2 x 4 keys x 8 = 64, AV 64; the causal mask halves them: 64
    attention = (64 + 64) // 2
    assert flops_per_token(TINY) == 6 * weights + 3 * TINY.layers * attention == 7392 + 384
    assert step_flops(TINY) == 7776 * 6 * 4


def test_weight_term_is_the_models_matmul_weights():
    """6 x the HF model's matmul weights (every Linear; the embedding lookup does no multiply-adds)."""
    import torch

    model = build(TINY)[0]
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert flops_per_token(TINY) - 6 * TINY.layers * TINY.seq * TINY.hidden == 6 * linear


def test_rows_are_table_4():
    assert [(r.gpus, r.tp, r.cp, r.pp, r.dp, r.seq, r.tflops) for r in ROWS] == [
        (8192, 8, 1, 16, 64, 8192, 430.0), (16384, 8, 1, 16, 128, 8192, 400.0), (16384, 8, 16, 16, 8, 131072, 380.0)]
    for r in ROWS:
        assert r.batch * r.seq == 2**24                                 # 16M tokens per batch
        assert r.tflops / 989.4 == pytest.approx(r.mfu, abs=0.006)    # BF16 MFU of the H100 SXM's dense peak
    assert [r.microbatches for r in ROWS] == [32, 16, 16]
    assert ROWS[2].mesh_shape == ((16, 8, 16, 8), ("pp", "dp", "cp", "tp"))
    assert ROWS[0].mesh_shape == ((16, 64, 8), ("pp", "dp", "tp"))
    # 405B parameters: the model's weights (embedding, output layer and norms included)
    r = ROWS[0]
    gd = r.kv_heads * r.hidden // r.heads
    params = r.layers * (2 * r.hidden**2 + 2 * r.hidden * gd + 3 * r.hidden * r.ffn + 2 * r.hidden) + 2 * r.vocab * r.hidden
    assert params == pytest.approx(405.8e9, rel=1e-3)
    with pytest.raises(ValueError, match="tp x cp x pp x dp"):
        dataclasses.replace(ROWS[0], dp=32)


def test_scaled_keeps_the_mesh_and_gqa():
    for r in ROWS:
        s = scaled(r, 16)
        assert (s.gpus, s.tp, s.cp, s.pp, s.dp) == (r.gpus, r.tp, r.cp, r.pp, r.dp)
        assert s.kv_heads == r.kv_heads and s.heads > s.kv_heads and s.heads % s.kv_heads == 0
        assert s.layers >= s.pp and s.seq % s.cp == 0 and s.batch % s.dp == 0 and s.microbatches >= 2
        assert s.hidden == r.hidden // 16 and s.seq == r.seq // 16
    assert scaled(ROWS[0], 1) is ROWS[0]


@pytest.mark.slow
def test_forced_128k_layout_on_a_small_mesh():
    """(slow: a 4-D pipelined plan) the 128K row at 1/8 width on pp 2 x dp 2 x cp 2 x tp 2."""
    row = dataclasses.replace(scaled(ROWS[2], 8), gpus=16, tp=2, cp=2, pp=2, dp=2, layers=2, batch=4)
    plan, _ = plan_row(row, forced=True, time_budget=None)
    assert plan.mesh.axis_names == ("pp", "dp", "cp", "tp")
    assert forced_mismatches(row, plan) == [], forced_mismatches(row, plan)
    assert plan.memory_options.mixed_precision == "bf16" and plan.microbatches == 2
    cp = plan.mesh.axis_index("cp")
    attn = [d for d in plan.nodes.values() if d.op.startswith("aten.scaled_dot_product_attention")]
    assert attn and all(str(d.local[cp]).startswith("attn_") for d in attn), [d.local for d in attn]
    # the planner counts causal attention at its visible half, as the table does (1.40x at full size before)
    assert plan.flops == pytest.approx(step_flops(row), rel=0.02)
