"""Tiny Hugging Face mixture-of-experts language models (built from configs, no download) for
tests/test_moe_exact.py: every family whose experts module ``autopar::moe_experts`` recognises."""
from __future__ import annotations

import torch

from examples.hf_zoo import LogitsOnly, lm_loss

VOCAB, HIDDEN, SEQ, BATCH = 128, 32, 16, 8
_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=32, use_cache=False, attn_implementation="eager",
               bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _config(family: str, experts: int):
    import transformers as tf

    if family == "mixtral":
        return tf.MixtralConfig(intermediate_size=64, num_local_experts=experts, num_experts_per_tok=2, **_COMMON)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                 num_experts=experts, num_experts_per_tok=2, decoder_sparse_step=1, **_COMMON)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=experts,
                                 num_experts_per_tok=2, decoder_sparse_step=1, head_dim=8, **_COMMON)
    if family == "olmoe":
        return tf.OlmoeConfig(intermediate_size=32, num_experts=experts, num_experts_per_tok=2, **_COMMON)
    if family == "gpt_oss":
        return tf.GptOssConfig(intermediate_size=32, num_local_experts=experts, num_experts_per_tok=2, head_dim=8,
                               layer_types=["full_attention", "full_attention"], **_COMMON)
    if family == "granitemoe":
        return tf.GraniteMoeConfig(intermediate_size=32, num_local_experts=experts, num_experts_per_tok=2, **_COMMON)
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=experts,
                                   num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=0,
                                   q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                   v_head_dim=8, **{**_COMMON, "num_key_value_heads": 4})
    raise ValueError(family)


FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "granitemoe", "deepseek_v3")


def moe_lm(family: str = "mixtral", experts: int = 4, implementation: str | None = None) -> LogitsOnly:
    """A 2-layer causal LM of ``family`` with ``experts`` experts, top-2 routing; GPT-OSS's and
    DeepSeek's zero-initialised router biases get random values so routing depends on them."""
    import transformers as tf

    cfg = _config(family, experts)
    if implementation is not None:
        cfg._experts_implementation = implementation
    cls = {"mixtral": tf.MixtralForCausalLM, "qwen2_moe": tf.Qwen2MoeForCausalLM, "qwen3_moe": tf.Qwen3MoeForCausalLM,
           "olmoe": tf.OlmoeForCausalLM, "gpt_oss": tf.GptOssForCausalLM, "granitemoe": tf.GraniteMoeForCausalLM,
           "deepseek_v3": tf.DeepseekV3ForCausalLM}[family]
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("experts.gate_up_proj_bias") or name.endswith("experts.down_proj_bias"):
                p.normal_(0, 0.02)
    return LogitsOnly(model)


def batch(seed: int = 1, rows: int = BATCH):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (rows, SEQ), generator=g), torch.randint(0, VOCAB, (rows, SEQ), generator=g)


__all__ = ["FAMILIES", "moe_lm", "batch", "lm_loss"]
