"""Factories for ``autopar plan MODULE:FACTORY``: each returns (model, example_inputs, loss_fn, target).

Models are built on the meta device, so planning a 1.5B-parameter GPT needs no weights.
"""
from __future__ import annotations

import torch

from examples.models import GPT, Llama, lm_loss


def _tokens(batch: int, seq: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def gpt2_xl(batch: int = 64, seq: int = 1024):
    """GPT-2 XL shape: 48 layers, hidden 1600, 25 heads, 1.56B parameters."""
    with torch.device("meta"):
        model = GPT(vocab=50257, hidden=1600, heads=25, layers=48, seq=seq)
    x = _tokens(batch, seq, 50257)
    return model, (x,), lm_loss, x


def gpt2_small(batch: int = 16, seq: int = 1024):
    with torch.device("meta"):
        model = GPT(vocab=50257, hidden=768, heads=12, layers=12, seq=seq)
    x = _tokens(batch, seq, 50257)
    return model, (x,), lm_loss, x


def llama_1b(batch: int = 16, seq: int = 2048):
    with torch.device("meta"):
        model = Llama(vocab=32000, hidden=2048, heads=16, layers=16, seq=seq, ffn=5632)
    x = _tokens(batch, seq, 32000)
    return model, (x,), lm_loss, x
