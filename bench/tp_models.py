"""Models for the tensor-parallel benchmark, written so that torch's own TP (DTensor
``parallelize_module`` with the local outputs) runs them unchanged: attention reshapes use
``-1`` for the head count (local heads after a column split), as in torch's TP tutorial.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class FFN(nn.Module):
    def __init__(self, d: int, ffn: int):
        super().__init__()
        self.fc1 = nn.Linear(d, ffn)
        self.fc2 = nn.Linear(ffn, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class WideMLP(nn.Module):
    """``depth`` residual blocks d -> ffn -> d."""

    def __init__(self, d: int = 1024, ffn: int = 4096, depth: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(FFN(d, ffn) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


class TPBlock(nn.Module):
    """Pre-LN transformer block with separate q/k/v projections (Megatron-shardable)."""

    def __init__(self, h: int, heads: int):
        super().__init__()
        self.head_dim = h // heads
        self.ln1 = nn.LayerNorm(h)
        self.q, self.k, self.v = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, _ = x.shape
        y = self.ln1(x)
        q, k, v = (t(y).view(b, s, -1, self.head_dim).transpose(1, 2) for t in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class BlockStack(nn.Module):
    def __init__(self, h: int = 256, heads: int = 8, layers: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(TPBlock(h, heads) for _ in range(layers))

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x


MEGATRON_PLANS = {
    "mlp": {"layers.*.fc1": "colwise", "layers.*.fc2": "rowwise"},
    "blocks": {"blocks.*.q": "colwise", "blocks.*.k": "colwise", "blocks.*.v": "colwise",
               "blocks.*.proj": "rowwise", "blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"},
}


def torch_plan(kind: str) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return {k: styles[v]() for k, v in MEGATRON_PLANS[kind].items()}


def expected_specs(kind: str, model: nn.Module) -> dict[str, str]:
    """Parameter name -> the Megatron placement on a 1-D tp mesh ("[S(0)]", "[S(1)]", "[R]")."""
    import fnmatch

    out = {}
    for name, _ in model.named_parameters():
        mod, leaf = name.rsplit(".", 1)
        style = next((v for k, v in MEGATRON_PLANS[kind].items() if fnmatch.fnmatchcase(mod, k)), None)
        if style == "colwise":
            out[name] = "[S(0)]"
        elif style == "rowwise":
            out[name] = "[S(1)]" if leaf == "weight" else "[R]"
        else:
            out[name] = "[R]"
    return out
