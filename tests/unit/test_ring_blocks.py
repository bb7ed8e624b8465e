"""Ring attention's blocks on the fused CPU kernel (``collectives/fused_blocks``): the
last piece's queries against every key block, merged by log-sum-exp, equal one
``scaled_dot_product_attention`` call in forward and in all three gradients."""
from __future__ import annotations

import pytest
import torch

from autopar.collectives import fused_blocks
from autopar.sharding.cp_positions import runs, tiles
from bench.gpu_ring_blocks import ring_share


def test_which_blocks_run_fused():
    q = torch.zeros(1, 1, 4, 2)
    qpos, before, same, after = torch.arange(4, 8), torch.arange(0, 4), torch.arange(4, 8), torch.arange(8, 12)
    kinds = {name: [t[2] for t in tiles(qpos, k, True)] for name, k in
             (("before", before), ("same", same), ("offset", torch.arange(2, 6)), ("after", after))}
    assert kinds == {"before": ["full"], "same": ["causal"], "offset": ["full", "partial"], "after": []}
    assert fused_blocks.kind(q, None, "full") == "full"
    assert fused_blocks.kind(q, None, "causal") == "causal"
    assert fused_blocks.kind(q, None, "partial") is None                               # partly visible
    assert fused_blocks.kind(q, torch.ones(4, 4, dtype=torch.bool), "full") is None   # a mask
    assert fused_blocks.kind(q.to("meta"), None, "full") is None                       # no fused kernel there
    assert fused_blocks.kind(q.to(torch.float64), None, "causal") == "causal"          # the CPU kernel: any float


def test_runs_and_tiles_of_a_zigzag_rank():
    pos = torch.tensor([2, 3, 4, 9, 10, 0])
    assert runs(pos) == [slice(0, 3), slice(3, 5), slice(5, 6)]
    assert runs(torch.tensor([], dtype=torch.long)) == []
    qpos, kpos = torch.tensor([2, 3, 12, 13]), torch.arange(16)
    got = [(t[0], t[1], t[2]) for t in tiles(qpos, kpos, True)]
    assert got == [(slice(0, 2), slice(0, 2), "full"), (slice(0, 2), slice(2, 4), "causal"),
                   (slice(2, 4), slice(0, 12), "full"), (slice(2, 4), slice(12, 14), "causal")]


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


@pytest.mark.parametrize("contiguous", [False, True])
def test_one_ring_rank_as_the_runtime_runs_it_equals_one_attention_call(contiguous):
    """``bench/gpu_ring_rank.py``: a rank's blocks through ``_attend`` / ``_attend_grad`` give one SDPA call's
    output and gradients (fp32, CPU), so what it times on a GPU is the exact computation."""
    import argparse

    from bench.gpu_ring_rank import check_and_time

    args = argparse.Namespace(seq=96, n=3, heads=2, dim=8, contiguous=contiguous, reps=1)
    for rank in range(3):
        row = check_and_time(args, rank, "cpu", torch.float32)
        assert max(row["rel_err_out_dq_dk_dv"]) < 1e-5, row
