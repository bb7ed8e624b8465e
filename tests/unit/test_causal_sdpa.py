"""Hugging Face SDPA attention traces as one process runs it (``autopar/frontend/causal_sdpa.py``):
``is_causal=True`` and no materialised mask, nothing mask-sized crossing a pipeline cut, the same
loss as the model's own forward; the SDPA rule splits grouped-query heads in equal blocks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.frontend.causal_sdpa import causal_sdpa_without_mask
from autopar.frontend.trace import trace
from autopar.sharding.rules.attention import sdpa as sdpa_rule

SEQ = 24


def _mixtral(impl: str = "sdpa", layers: int = 2, **extra):
    import transformers as tf

    from examples.hf_zoo import LogitsOnly

    cfg = tf.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           use_cache=False, attn_implementation=impl, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                           **extra)
    torch.manual_seed(0)
    return LogitsOnly(tf.MixtralForCausalLM(cfg))


def _loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _sdpa_nodes(gm):
    return [n for n in gm.graph.nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default]


def _square_masks(gm, seq: int):
    """Nodes holding a [..., seq, seq] tensor that is not attention's own q/k/v."""
    return [n.name for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
            and n.meta["val"].dim() == 4 and n.meta["val"].shape[1] == 1 and tuple(n.meta["val"].shape[-2:]) == (seq, seq)]


def _run(traced, model, x, y):
    """The traced step on the model's real parameters (placeholder order)."""
    named = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    args = []
    for n in traced.gm.graph.nodes:
        if n.op != "placeholder":
            continue
        if n.name in traced.params:
            args.append(named[traced.params[n.name]])
        elif n.name in traced.buffers:
            args.append(named[traced.buffers[n.name]])
        elif n.name in traced.constants:
            args.append(traced.constants[n.name])
        elif n.name == traced.target:
            args.append(y)
        else:
            args.append(x)
    return traced.gm(*args)[traced.loss_index]


def test_hf_sdpa_traces_is_causal_without_a_mask_and_matches_one_process():
    model = _mixtral()
    x = torch.randint(0, 128, (2, SEQ))
    traced = trace(model, (x,), _loss, x)
    nodes = _sdpa_nodes(traced.gm)
    assert len(nodes) == 2
    for n in nodes:
        args = list(n.args) + [None] * 6
        assert args[3] is None and n.kwargs.get("attn_mask") is None, n.args
        assert args[5] is True or n.kwargs.get("is_causal") is True, (n.args, n.kwargs)
    assert _square_masks(traced.gm, SEQ) == []
    with torch.no_grad():
        want = _loss(model(x), x)
        got = _run(traced, model, x, x)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), (got, want)


def test_given_positions_or_eager_keep_their_mask():
    """Positions passed in (maybe packed sequences) and eager attention defer to transformers."""
    model = _mixtral("eager", layers=1)
    x = torch.randint(0, 128, (2, SEQ))
    assert _square_masks(trace(model, (x,), _loss, x).gm, SEQ)

    class WithPositions(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = _mixtral(layers=1).inner

        def forward(self, idx, pos):
            return self.inner(input_ids=idx, position_ids=pos).logits

    pos = torch.arange(SEQ).repeat(2, 1)
    traced = trace(WithPositions(), (x, pos), _loss, x)
    assert _square_masks(traced.gm, SEQ), "positions given as an input must keep the packed-sequence mask"


def test_patch_is_undone():
    from transformers import masking_utils

    before = (masking_utils._ignore_causal_mask_sdpa, masking_utils.find_packed_sequence_indices)
    with causal_sdpa_without_mask():
        assert masking_utils._ignore_causal_mask_sdpa is not before[0]
    assert (masking_utils._ignore_causal_mask_sdpa, masking_utils.find_packed_sequence_indices) == before


def test_sdpa_rule_splits_grouped_query_heads():
    model = _mixtral(layers=1)
    x = torch.randint(0, 128, (2, SEQ))
    node = _sdpa_nodes(trace(model, (x,), _loss, x).gm)[0]
    assert node.kwargs.get("enable_gqa") is True
    opts = sdpa_rule(node)
    heads = [o for o in opts if o.name == "heads"]
    assert heads and heads[0].inputs[:3] == (autopar.Shard(1),) * 3 and heads[0].output == autopar.Shard(1)
    assert sorted(o.local for o in opts if o.name == "cp") == ["attn_gather:cp", "attn_ring:cp"]


@pytest.mark.slow
def test_pipeline_cut_sends_no_mask():
    """(slow: a pipelined plan) The stage boundary carries hidden states and rotary tables only."""
    model = _mixtral()
    x = torch.zeros(4, SEQ, dtype=torch.long)
    mesh = autopar.Mesh((2, 2), axis_names=("pp", "dp"))
    autopar.set_auto_parallel_context(microbatches=2)
    plan = autopar.plan(model, mesh, example_inputs=(x,), loss_fn=_loss, example_target=x, mode="semi_auto")
    assert plan.degrees["pp"] == 2
    sends = {c.node: c.bytes for c in plan.collectives(rank=0) if c.kind == "send" and c.phase == "fwd"}
    assert sends
    hidden = 4 // 2 * SEQ * 64 * 4                       # a microbatch's hidden states, fp32
    rotary = SEQ * (64 // 4) * 4                         # cos or sin: seq x head_dim, fp32
    assert set(sends.values()) <= {hidden, rotary}, sends
