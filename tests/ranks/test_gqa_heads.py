"""HF Llama with sdpa and grouped-query heads (4 query, 2 key/value heads) traces with ``is_causal``
and ``enable_gqa`` (frontend/causal_sdpa.py); its attention split by heads over tp 2 (each rank 2
query heads and their 1 key/value head) trains like one device: loss, gathered gradients before
every SGD step and parameters after it at 1e-5 (tests/oracle.py)."""
from __future__ import annotations

import pytest
import torch

import autopar
import conftest
from cp_models import token_loss, tokens
from oracle import assert_same_training, parallel_run, reference_run

pytest.importorskip("transformers")

BATCH = 2
HEADS = ("q_proj", "k_proj", "v_proj")


def _llama():
    from hf_zoo import llama

    torch.manual_seed(0)
    return llama(1, attn_implementation="sdpa", num_key_value_heads=2, max_position_embeddings=64)


def _heads(model):
    for name in HEADS:
        autopar.shard(f"inner.model.layers.*.self_attn.{name}", weight={"tp": autopar.Shard(0)})
    autopar.shard("inner.model.layers.*.self_attn.o_proj", weight={"tp": autopar.Shard(1)})


def _job(rank):
    x, y = tokens(BATCH)
    return parallel_run(rank, _llama, token_loss, x, y, autopar.Mesh(2, axis_names=("tp",)), "semi_auto",
                        setup=_heads)


def test_hf_llama_sdpa_gqa_heads_split_tp2_trains_like_one_device():
    x, y = tokens(BATCH)
    ref = reference_run(_llama, token_loss, x, y)
    results = conftest._pool(2).run(conftest._fresh_call, _job, timeout_s=600)
    for r in results:
        assert_same_training(ref, r, what="gqa heads tp2")
    plan = autopar.Plan.from_json(results[0]["plan"])
    attn = [n for n in plan.nodes.values() if "scaled_dot_product_attention" in n.op]
    assert attn and all(n.strategy == "heads" for n in attn), [(n.strategy, n.inputs) for n in attn]
