"""Small models for the context-parallel tests: a GPT (causal sdpa, learned positions) and a
BERT-style encoder (bidirectional sdpa with a key padding mask)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ, D, HEADS = 64, 64, 32, 4


class Block(nn.Module):
    def __init__(self, causal: bool, heads: int = HEADS):
        super().__init__()
        self.causal, self.heads = causal, heads
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x, mask=None):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(c, -1))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, causal: bool = True, layers: int = 2, pad_mask: bool = False, seq: int = SEQ,
                 heads: int = HEADS):
        super().__init__()
        torch.manual_seed(0)
        self.pad_mask = pad_mask
        self.tok, self.pos = nn.Embedding(VOCAB, D), nn.Embedding(seq, D)
        self.blocks = nn.ModuleList(Block(causal, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        mask = (ids != 0)[:, None, None, :] if self.pad_mask else None
        for blk in self.blocks:
            x = blk(x, mask)
        return self.head(self.ln(x))


def encoder():
    return TinyGPT(causal=False, pad_mask=True)


def token_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def tokens(batch: int, pad: int = 0, seed: int = 1, seq: int = SEQ):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, VOCAB, (batch, seq), generator=g)
    if pad:
        x[:, -pad:] = 0
    return x, torch.randint(0, VOCAB, (batch, seq), generator=g)
