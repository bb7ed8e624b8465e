"""Tiny Hugging Face mixture-of-experts language models built from configs (nothing downloaded).

``moe_model(name, aux=False, **overrides)`` returns a :class:`examples.hf_zoo.ZooModel` whose module
takes token ids positionally (``module(idx)``) and returns the logits, or, with ``aux=True``, the
logits and the router's load-balancing loss (``output_router_logits=True``); its ``loss_fn`` is then
what the model's own ``.loss`` is with labels: token cross entropy + ``router_aux_loss_coef * aux``.
Settings as in ``examples/hf_zoo.py``: ``use_cache=False``, no dropout, eager attention (DeepSeek-V3
uses sdpa: the path its one-process run takes with ``num_key_value_heads < num_attention_heads``).
Every model has 4 experts, 2 per token, hidden 64, 2 layers (docs/zoo.md, "Mixture of experts").
"""
from __future__ import annotations

import torch

from examples.hf_zoo import VOCAB, ZooModel, lm_loss

MOE_NAMES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "granitemoe", "deepseek_v3")
NO_AUX_LOSS = ("deepseek_v3",)   # its router balances with a bias term; .aux_loss is None
SEQ, HIDDEN = 16, 64

_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=32, use_cache=False, attn_implementation="eager",
               bos_token_id=0, eos_token_id=0, pad_token_id=0, num_experts_per_tok=2, router_aux_loss_coef=0.02)

# name -> (config class, model class, family settings)
_FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=64, num_local_experts=4)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                       num_experts=4)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=64, moe_intermediate_size=32, num_experts=4, head_dim=16)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(intermediate_size=32, num_experts=4)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(intermediate_size=32, num_local_experts=4, head_dim=16, sliding_window=8,
                     layer_types=["sliding_attention", "full_attention"],
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(intermediate_size=32, num_local_experts=4)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                         n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, attn_implementation="sdpa")),
}


class MoELM(torch.nn.Module):
    """A causal MoE language model called on token ids: ``logits`` or ``(logits, aux_loss)``."""

    def __init__(self, inner: torch.nn.Module, aux: bool):
        super().__init__()
        self.inner, self.aux = inner, aux

    def forward(self, idx):
        out = self.inner(input_ids=idx, output_router_logits=self.aux)
        return (out.logits, out.aux_loss) if self.aux else out.logits


def moe_config(name: str, **overrides):
    import transformers

    if name not in _FAMILIES:
        raise ValueError(f"unknown MoE zoo model {name!r}: choose one of {', '.join(MOE_NAMES)}")
    config_cls, _, family = _FAMILIES[name]
    return getattr(transformers, config_cls)(**{**_COMMON, **family, **overrides})


def moe_model(name: str, batch: int = 4, seed: int = 1, aux: bool = False, **overrides) -> ZooModel:
    """The tiny ``name`` model (MOE_NAMES), its token inputs (positional) and loss; ``aux``: the loss adds
    the router's load-balancing loss as the model's ``.loss`` does with labels."""
    import transformers

    config = moe_config(name, **overrides)
    if aux and name in NO_AUX_LOSS:
        raise ValueError(f"{name} has no router load-balancing loss in transformers (its router balances with "
                         f"a bias, not a loss): call moe_model({name!r}) without aux=True")
    module = MoELM(getattr(transformers, _FAMILIES[name][1])(config), aux)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, VOCAB, (batch, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    coef = config.router_aux_loss_coef

    def aux_loss(out, target):
        logits, balance = out
        return lm_loss(logits, target) + coef * balance

    return ZooModel(module, ((x,), {}), aux_loss if aux else lm_loss, y)
