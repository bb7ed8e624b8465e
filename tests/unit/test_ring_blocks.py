"""Ring attention's blocks on the fused CPU kernel (``collectives/fused_blocks``): the
last piece's queries against every key block, merged by log-sum-exp, equal one
``scaled_dot_product_attention`` call in forward and in all three gradients."""
from __future__ import annotations

import pytest
import torch

from autopar.collectives import fused_blocks
from bench.gpu_ring_blocks import ring_share


def test_which_blocks_run_fused():
    q = torch.zeros(1, 1, 4, 2)
    qpos, before, same, after = torch.arange(4, 8), torch.arange(0, 4), torch.arange(4, 8), torch.arange(8, 12)
    assert fused_blocks.kind(q, None, qpos, before, True) == "full"
    assert fused_blocks.kind(q, None, qpos, same, True) == "causal"
    assert fused_blocks.kind(q, None, qpos, torch.arange(2, 6), True) is None        # partly visible, offset
    assert fused_blocks.kind(q, torch.ones(4, 4, dtype=torch.bool), qpos, before, True) is None   # a mask
    assert fused_blocks.kind(q, None, qpos, after, False) == "full"
    assert fused_blocks.kind(q.to("meta"), None, qpos, before, True) is None          # not the CPU


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_fused_blocks_equal_one_attention_call(dtype, tol):
    n, L = 4, 16
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, L, 8, generator=g, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, 3, n * L, 8, generator=g, dtype=dtype, requires_grad=True) for _ in range(2))
    mask = torch.arange((n - 1) * L, n * L)[:, None] >= torch.arange(n * L)[None, :]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref.backward(torch.ones_like(ref))
    want = [ref.detach(), q.grad, k.grad, v.grad]
    with torch.no_grad():
        for fused in (True, False):
            got = ring_share(q.detach(), k.detach(), v.detach(), n, fused)
            for a, b, what in zip(got, want, ("out", "dq", "dk", "dv")):
                err = float((a - b).abs().max() / b.abs().max())
                assert err < tol, f"{'fused' if fused else 'explicit'} {what}: {err}"
