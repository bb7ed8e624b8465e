"""Tiny Hugging Face language models built from configs (no download), returning logits only."""
from __future__ import annotations

import torch


class LogitsOnly(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, idx):
        return self.inner(input_ids=idx).logits


def gpt2(layers: int = 2) -> LogitsOnly:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=128, n_embd=64, n_layer=layers, n_head=4, n_positions=32, use_cache=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return LogitsOnly(GPT2LMHeadModel(cfg))


def llama(layers: int = 2) -> LogitsOnly:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=4, intermediate_size=128, max_position_embeddings=32, use_cache=False,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LogitsOnly(LlamaForCausalLM(cfg))


def bert(layers: int = 2) -> LogitsOnly:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, pad_token_id=0)
    return LogitsOnly(BertForMaskedLM(cfg))


def lm_loss(logits, y):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
