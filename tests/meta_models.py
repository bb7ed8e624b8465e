"""Models whose initialization a meta-built model can replay (tests/ranks/test_meta_init.py)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from semantics_models import HIDDEN, SEQ, VOCAB, KitchenBlock


class ReplayableKitchen(nn.Module):
    """``semantics_models.Kitchen`` (sliced, tied, frozen and unused parameters, an int buffer updated
    in place, BatchNorm, a custom autograd Function) with its own tensors set by ``reset_parameters``,
    called at the end of ``__init__`` as torch's layers do."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Parameter(torch.empty(2 * SEQ, HIDDEN))
        self.blocks = nn.ModuleList(KitchenBlock(HIDDEN) for _ in range(layers))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.trunc_normal_(self.pos, std=0.1, a=-0.15, b=0.15)
        self.calls.zero_()

    def forward(self, x):
        self.calls += 1
        h = self.emb(x) + self.pos[: x.shape[1]]
        for blk in self.blocks:
            h = blk(h)
        return self.head(h)


class TitanStyle(nn.Module):
    """torchtitan's convention: ``init_weights()`` sets every tensor (built on meta, ``to_empty``, seeded,
    ``init_weights()``), including a rotary table recomputed there and scaled output layers."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(layers))
        self.norm = nn.LayerNorm(HIDDEN)
        self.out = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.register_buffer("freqs", self._freqs(), persistent=False)

    @staticmethod
    def _freqs():
        return 1.0 / (10000 ** (torch.arange(0, HIDDEN, 2, dtype=torch.float32) / HIDDEN))

    def init_weights(self):
        self.freqs = self._freqs()
        nn.init.normal_(self.tok.weight)
        for i, layer in enumerate(self.layers):
            nn.init.trunc_normal_(layer.weight, std=0.02 / math.sqrt(2 * (i + 1)))
            nn.init.zeros_(layer.bias)
        self.norm.reset_parameters()
        nn.init.trunc_normal_(self.out.weight, std=HIDDEN ** -0.5, a=-3 * HIDDEN ** -0.5, b=3 * HIDDEN ** -0.5)

    def forward(self, x):
        h = self.tok(x)
        h = h * torch.cat([self.freqs, self.freqs]).cos()
        for layer in self.layers:
            h = h + F.gelu(layer(h))
        return self.out(self.norm(h))


def titan_reference(seed: int = 0, layers: int = 2) -> TitanStyle:
    """A ``TitanStyle`` built as torchtitan builds one on one device: meta, ``to_empty(cpu)``, seed, init."""
    with torch.device("meta"):
        model = TitanStyle(layers)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model
