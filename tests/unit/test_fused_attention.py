"""SDPA with a value head dim other than the query's (DeepSeek's MLA) is costed as the fused kernel on a
GPU preset and as the math decomposition the CPU runs (``cost_models/fused_attention.py``)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.cost_models.compute import node_cost, node_work
from autopar.cost_models.devices import get_device
from autopar.frontend.trace import trace


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q * self.w, k, v, is_causal=True)


def _sdpa_node(dq: int, dv: int, heads=4, seq=256):
    q, k, v = torch.randn(2, heads, seq, dq), torch.randn(2, heads, seq, dq), torch.randn(2, heads, seq, dv)
    traced = trace(_Attn(), (q, k, v))
    return next(n for n in traced.gm.graph.nodes if "scaled_dot_product" in str(n.target))


def test_unequal_head_dims_cost_as_fused_on_a_gpu_preset_only():
    mla, small, large = _sdpa_node(48, 32), _sdpa_node(32, 32), _sdpa_node(48, 48)
    assert node_work(mla).kernels_fwd > 1 and node_work(small).kernels_fwd == 1   # CPU's math path vs fused
    h800 = get_device("h800")
    t = {n: node_cost(x, h800).time_total for n, x in (("mla", mla), ("small", small), ("large", large))}
    assert t["small"] <= t["mla"] <= t["large"]           # between its equal-dims neighbours
    c = node_cost(mla, h800)
    assert c.flops_fwd == pytest.approx(2 * 2 * 4 * 256 * 256 * (48 + 32) * (256 + 1) / (2 * 256))
    assert c.flops_bwd == pytest.approx(2 * c.flops_fwd)
    assert c.bytes_fwd == pytest.approx(4 * 2 * 4 * 256 * (48 + 48 + 32 + 32))
    cpu = get_device("cpu")
    assert node_cost(mla, cpu).bytes_fwd == pytest.approx(node_work(mla).bytes_fwd)   # the CPU runs the math path
