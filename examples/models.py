"""Small models used by the demo, tests and benchmarks: MLP, CNN with BatchNorm, GPT (tied
embeddings), Llama-style (RMSNorm, SwiGLU, rotary) and a BERT-style encoder."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in=32, hidden=64, d_out=10, depth=2):
        super().__init__()
        dims = [d_in] + [hidden] * depth
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x):
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(x)


class CNN(nn.Module):
    def __init__(self, channels=8, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * channels)
        self.fc = nn.Linear(2 * channels * 4 * 4, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.adaptive_avg_pool2d(F.relu(self.bn2(self.conv2(x))), 4)
        return self.fc(x.flatten(1))


class Block(nn.Module):
    def __init__(self, h, heads, dropout=0.0, fused_qkv=True, qkv_bias=True):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(h)
        self.fused = fused_qkv
        if fused_qkv:
            self.qkv = nn.Linear(h, 3 * h, bias=qkv_bias)
        else:
            self.q, self.k, self.v = (nn.Linear(h, h, bias=qkv_bias) for _ in range(3))
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, s, h = x.shape
        y = self.ln1(x)
        if self.fused:
            q, k, v = self.qkv(y).split(h, dim=-1)
        else:
            q, k, v = self.q(y), self.k(y), self.v(y)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, s, h)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class GPT(nn.Module):
    """GPT-2 style: learned positions, pre-LN blocks, tied input/output embeddings."""

    def __init__(self, vocab=128, hidden=64, heads=4, layers=2, seq=16, dropout=0.0, fused_qkv=True, qkv_bias=True):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, dropout, fused_qkv, qkv_bias) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.reset_parameters()

    def reset_parameters(self):
        """GPT-2's init of every layer, run at the end of ``__init__`` (a meta-built model replays it)."""
        self.apply(_gpt2_init)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.ln_f(x))


def _gpt2_init(m: nn.Module) -> None:
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


class RMSNorm(nn.Module):
    def __init__(self, h, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, h, heads, ffn):
        super().__init__()
        self.heads = heads
        self.attn_norm = RMSNorm(h)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(h, h, bias=False) for _ in range(4))
        self.ffn_norm = RMSNorm(h)
        self.w1, self.w3 = nn.Linear(h, ffn, bias=False), nn.Linear(h, ffn, bias=False)
        self.w2 = nn.Linear(ffn, h, bias=False)

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        y = self.attn_norm(x)
        q, k, v = (w(y).view(b, s, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)      # fp32 tables, bf16 compute under mixed precision
        q = q * cos + _rotate(q) * sin
        k = k * cos + _rotate(k) * sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, h))
        y = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(y)) * self.w3(y))


class Llama(nn.Module):
    def __init__(self, vocab=128, hidden=64, heads=4, layers=2, seq=16, ffn=128):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(LlamaBlock(hidden, heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)
        hd = hidden // heads
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        f = torch.outer(torch.arange(seq).float(), inv)
        emb = torch.cat((f, f), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return self.out(self.norm(x))


class BertLayer(nn.Module):
    def __init__(self, h, heads, dropout=0.0):
        super().__init__()
        self.heads = heads
        self.q, self.v, self.o = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.k = nn.Linear(h, h, bias=False)  # a key bias has an exactly zero gradient (softmax shift)
        self.ln1 = nn.LayerNorm(h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.ln2 = nn.LayerNorm(h)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask):
        b, s, h = x.shape
        q, k, v = (t(x).view(b, s, self.heads, -1).permute(0, 2, 1, 3) for t in (self.q, self.k, self.v))
        w = (q @ k.transpose(-2, -1)) / math.sqrt(h // self.heads) + mask
        a = (self.drop(F.softmax(w, dim=-1)) @ v).permute(0, 2, 1, 3).reshape(b, s, h)
        x = self.ln1(x + self.drop(self.o(a)))
        return self.ln2(x + self.drop(self.fc2(F.gelu(self.fc1(x)))))


class Bert(nn.Module):
    """BERT-style encoder (post-LN, hand-written attention with a padding mask) + classifier."""

    def __init__(self, vocab=128, hidden=64, heads=4, layers=2, seq=16, classes=4):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.layers = nn.ModuleList(BertLayer(hidden, heads) for _ in range(layers))
        self.pool = nn.Linear(hidden, hidden)
        self.cls = nn.Linear(hidden, classes)

    def forward(self, idx):
        mask = ((idx == 0).to(torch.float32) * -1e4)[:, None, None, :]
        x = self.ln(self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)))
        for layer in self.layers:
            x = layer(x, mask)
        return self.cls(torch.tanh(self.pool(x[:, 0])))
