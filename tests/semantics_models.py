"""Small models with what ordinary models have and the oracle models lack: parameters used through a
slice, frozen, tied and unused parameters, an integer buffer updated in place, BatchNorm, a custom
autograd Function."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ, HIDDEN = 32, 8, 16


class Sliced(nn.Module):
    """A learned position table used through a slice (``pos[: x.shape[1]]``), at the root module."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Parameter(torch.randn(2 * SEQ, HIDDEN) * 0.1)
        self.fc = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x):
        return self.fc(torch.tanh(self.emb(x) + self.pos[: x.shape[1]]))


class Frozen(Sliced):
    def __init__(self):
        super().__init__()
        self.emb.weight.requires_grad_(False)


class Unused(Sliced):
    """A root-level parameter the forward never reads."""

    def __init__(self):
        super().__init__()
        self.spare = nn.Parameter(torch.randn(HIDDEN))


class StraightThroughRound(torch.autograd.Function):
    """Round to quarters forward, identity backward: autograd of the forward would give zero."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class KitchenBlock(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.frozen = nn.Linear(h, h)
        self.frozen.requires_grad_(False)
        self.norm = nn.BatchNorm1d(h)
        self.fc1 = nn.Linear(h, 2 * h)
        self.fc2 = nn.Linear(2 * h, h)
        self.unused = nn.Linear(h, h)

    def forward(self, x):
        b, t, d = x.shape
        x = x + torch.tanh(self.frozen(StraightThroughRound.apply(x)))
        y = self.norm(x.reshape(b * t, d)).reshape(b, t, d)
        return x + self.fc2(F.gelu(self.fc1(y)))


class Kitchen(nn.Module):
    """Sliced, tied, frozen and unused parameters, an int buffer updated in place, BatchNorm, a custom
    autograd Function, 2 layers."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Parameter(torch.randn(2 * SEQ, HIDDEN) * 0.1)
        self.blocks = nn.ModuleList(KitchenBlock(HIDDEN) for _ in range(layers))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        h = self.emb(x) + self.pos[: x.shape[1]]
        for blk in self.blocks:
            h = blk(h)
        return self.head(h)


def token_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def tokens(batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, SEQ), generator=g), torch.randint(0, VOCAB, (batch, SEQ), generator=g)
