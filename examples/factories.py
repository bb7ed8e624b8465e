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


def gpt(hidden: int = 2048, layers: int = 24, heads: int = 16, seq: int = 1024, batch: int = 1024,
        vocab: int = 51200):
    """A GPT of any size (GPT-3 paper / Megatron-LM naming: hidden, layers, heads), vocab 51200."""
    with torch.device("meta"):
        model = GPT(vocab=vocab, hidden=hidden, heads=heads, layers=layers, seq=seq)
    x = _tokens(batch, seq, vocab)
    return model, (x,), lm_loss, x


def gpt_1_3b(batch: int = 1024, seq: int = 1024):
    """GPT-3 XL shape (1.3B): hidden 2048, 24 layers, 16 heads."""
    return gpt(2048, 24, 16, seq, batch)


def gpt_6_7b(batch: int = 512, seq: int = 1024):
    """GPT-3 6.7B shape: hidden 4096, 32 layers, 32 heads."""
    return gpt(4096, 32, 32, seq, batch)


def llama_7b(batch: int = 256, seq: int = 4096):
    """Llama-2 7B shape: hidden 4096, 32 layers, 32 heads, SwiGLU 11008, vocab 32000."""
    with torch.device("meta"):
        model = Llama(vocab=32000, hidden=4096, heads=32, layers=32, seq=seq, ffn=11008)
    x = _tokens(batch, seq, 32000)
    return model, (x,), lm_loss, x


def llama_70b(batch: int = 1024, seq: int = 4096):
    """Llama-2 70B's width and depth: hidden 8192, 80 layers, 64 heads, SwiGLU 28672, vocab 32000.
    The example Llama has no grouped-query attention: its key/value projections are full width
    (h x h, not h x 1024), so this model has 78B parameters rather than 69B."""
    with torch.device("meta"):
        model = Llama(vocab=32000, hidden=8192, heads=64, layers=80, seq=seq, ffn=28672)
    x = _tokens(batch, seq, 32000)
    return model, (x,), lm_loss, x
