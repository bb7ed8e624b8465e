"""A GPT written out by hand for the cost-model tests (hand-written attention keeps the s^2 terms)."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """Pre-LN transformer block; hand-written attention unless ``sdpa``."""

    def __init__(self, h, heads, sdpa, p=0.1):
        super().__init__()
        self.heads, self.sdpa, self.p = heads, sdpa, p
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(h, -1))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            att = F.dropout(att.masked_fill(~causal, float("-inf")).softmax(-1), self.p, self.training)
            y = att @ v
        x = x + F.dropout(self.proj(y.transpose(1, 2).reshape(b, s, h)), self.p, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.p, self.training)


class GPT(nn.Module):
    """Tied embeddings, learned positions, pre-LN blocks, 4h MLP, cross-entropy loss."""

    def __init__(self, vocab, seq, h, heads, layers, sdpa=False, p=0.1):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads, sdpa, p) for _ in range(layers))
        self.lnf = nn.LayerNorm(h)

    def forward(self, idx, target):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.lnf(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1))
