"""The sequence-split attention rule offers the ring form only without dropout; a hand-edited plan
that runs the ring form with dropout gets a clear error."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar.collectives.attention_cp import attention_ring
from autopar.frontend.trace import trace
from autopar.sharding.rules.attention import sdpa


class Attn(torch.nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        q = self.proj(x).view(2, 16, 2, 4).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, dropout_p=self.p, is_causal=True).sum()


def _forms(p: float) -> set:
    traced = trace(Attn(p), (torch.randn(2, 16, 8),))
    node = next(n for n in traced.gm.graph.nodes if "scaled_dot_product_attention" in str(n.target))
    return {o.local for o in sdpa(node) if o.name == "cp"}


def test_ring_form_is_offered_only_without_dropout():
    assert _forms(0.0) == {"attn_gather:cp", "attn_ring:cp"}
    assert _forms(0.1) == {"attn_gather:cp"}


def test_ring_form_with_dropout_is_a_clear_error(monkeypatch):
    import autopar.collectives.attention_cp as cp

    monkeypatch.setattr(cp, "_split_axes", lambda axes: list(axes))
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="ring attention on an attention op with dropout.*make a new plan"):
        attention_ring(q, q, q, None, 0.1, _op="sdpa", _axes={"cp": ["cp"]})
