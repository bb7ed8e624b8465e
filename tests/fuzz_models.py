"""The models the fuzzer draws (``fuzz_cases.py``): an MLP and a small transformer, each built from a
frozen spec so that every rank (and the single-device reference) builds the same model from plain data.

The transformer's key projection never has a bias: softmax is shift-invariant along the keys, so a
key bias has an exactly zero true gradient, and AdamW turns the float noise in it into ±lr steps
that differ between any two summation orders (docs/testing.md). Query, value and output biases are
drawn like every other bias flag.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh, "silu": F.silu, "identity": lambda x: x}


@dataclass(frozen=True)
class MLPSpec:
    """``widths[i]`` is hidden layer i's width; ``acts[i]`` and ``bias[i]`` its activation and bias flag;
    the head maps the last width to ``classes`` (bias ``head_bias``)."""
    d_in: int
    widths: tuple[int, ...]
    acts: tuple[str, ...]
    bias: tuple[bool, ...]
    classes: int
    head_bias: bool = True

    family = "mlp"


@dataclass(frozen=True)
class TransformerSpec:
    """A pre-norm decoder: ``heads`` x ``hidden // heads`` attention, ``ffn``-wide MLP with ``act``,
    ``norm`` "layer" or "rms", ``tied`` input and output embeddings, ``fused_qkv`` one projection or three."""
    vocab: int
    seq: int
    hidden: int
    heads: int
    ffn: int
    layers: int
    tied: bool
    fused_qkv: bool
    bias: bool
    norm: str
    act: str

    family = "transformer"


class MLPLayer(nn.Module):
    def __init__(self, d_in: int, d_out: int, act: str, bias: bool):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out, bias=bias)
        self.act = act

    def forward(self, x):
        return ACTIVATIONS[self.act](self.fc(x))


class FuzzMLP(nn.Module):
    def __init__(self, spec: MLPSpec):
        super().__init__()
        dims = (spec.d_in,) + spec.widths
        self.layers = nn.ModuleList(MLPLayer(a, b, act, bias)
                                    for a, b, act, bias in zip(dims, dims[1:], spec.acts, spec.bias))
        self.head = nn.Linear(dims[-1], spec.classes, bias=spec.head_bias)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class RMSNorm(nn.Module):
    def __init__(self, h: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _norm(kind: str, h: int) -> nn.Module:
    return nn.LayerNorm(h) if kind == "layer" else RMSNorm(h)


class Block(nn.Module):
    def __init__(self, spec: TransformerSpec):
        super().__init__()
        h, b = spec.hidden, spec.bias
        self.heads, self.act, self.fused = spec.heads, spec.act, spec.fused_qkv
        self.ln1, self.ln2 = _norm(spec.norm, h), _norm(spec.norm, h)
        if spec.fused_qkv:
            self.qkv = nn.Linear(h, 3 * h, bias=False)      # no key bias (module docstring)
        else:
            self.q, self.k, self.v = nn.Linear(h, h, bias=b), nn.Linear(h, h, bias=False), nn.Linear(h, h, bias=b)
        self.proj = nn.Linear(h, h, bias=b)
        self.fc1, self.fc2 = nn.Linear(h, spec.ffn, bias=b), nn.Linear(spec.ffn, h, bias=b)

    def forward(self, x):
        bsz, s, h = x.shape
        y = self.ln1(x)
        q, k, v = self.qkv(y).split(h, dim=-1) if self.fused else (self.q(y), self.k(y), self.v(y))
        q, k, v = (t.view(bsz, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(bsz, s, h))
        return x + self.fc2(ACTIVATIONS[self.act](self.fc1(self.ln2(x))))


class FuzzTransformer(nn.Module):
    def __init__(self, spec: TransformerSpec):
        super().__init__()
        self.wte = nn.Embedding(spec.vocab, spec.hidden)
        self.wpe = nn.Embedding(spec.seq, spec.hidden)
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.layers))
        self.ln_f = _norm(spec.norm, spec.hidden)
        self.lm_head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        if spec.tied:
            self.lm_head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.05)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.ln_f(x))


def build(spec) -> nn.Module:
    """The model of ``spec`` (seed it first: the weights come from torch's global generator)."""
    return FuzzMLP(spec) if spec.family == "mlp" else FuzzTransformer(spec)


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def loss_of(spec):
    return F.cross_entropy if spec.family == "mlp" else lm_loss


def batch_of(spec, batch: int, seed: int = 1):
    """(inputs, targets) of ``batch`` samples for ``spec``'s model."""
    g = torch.Generator().manual_seed(seed)
    if spec.family == "mlp":
        return torch.randn(batch, spec.d_in, generator=g), torch.randint(0, spec.classes, (batch,), generator=g)
    x = torch.randint(0, spec.vocab, (batch, spec.seq), generator=g)
    return x, torch.randint(0, spec.vocab, (batch, spec.seq), generator=g)
