"""Context-parallel attention's blocks on the GPU's fused flash kernel (``collectives/fused_blocks``),
``pytest -m gpu``: skipped without CUDA (``AUTOPAR_GPU_TESTS_ON=cpu`` dry-runs them on the CPU kernel).

One rank's share without the ring or the gather (the local computation both forms run): the last piece's
queries against every key block merged by log-sum-exp (the ring), and a zig-zag rank's queries against all
keys as ``_TiledAttention`` (the all-gather form). Each is compared with ``scaled_dot_product_attention`` of
the same queries computed in fp32 from the same low-precision inputs, forward and the three gradients, and
must land no further from it than the explicit block path does (plus a bf16 rounding step).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from autopar.collectives import fused_blocks
from autopar.collectives.attention_cp import _TiledAttention
from autopar.sharding.cp_positions import held
from bench.gpu_ring_blocks import ring_share

DEV = os.environ.get("AUTOPAR_GPU_TESTS_ON", "cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(),
                                                  reason="needs a CUDA device")]
LOW = [torch.bfloat16, torch.float16] if DEV == "cuda" else [torch.float32]
KERNELS = ["preferred", "flash"] if DEV == "cuda" else ["preferred"]     # "flash": with cuDNN's SDPA off


@pytest.fixture(params=KERNELS)
def kernel(request):
    """The fused kernel the blocks run on: the one SDPA prefers here (cuDNN on compute capability 9.0+),
    or flash with cuDNN's SDPA switched off."""
    was = torch.backends.cuda.cudnn_sdp_enabled() if DEV == "cuda" else None
    if request.param == "flash":
        torch.backends.cuda.enable_cudnn_sdp(False)
    yield request.param
    if was is not None:
        torch.backends.cuda.enable_cudnn_sdp(was)


def _inputs(lq: int, lk: int, dtype, heads: int = 4, dim: int = 64):
    g = torch.Generator(device=DEV).manual_seed(0)
    return [torch.randn(2, heads, n, dim, device=DEV, dtype=dtype, generator=g) for n in (lq, lk, lk)]


def _reference(q, k, v, qpos, kpos, g):
    """fp32 attention of q (at qpos) to k, v (at kpos) under the causal mask, and its gradients."""
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q32, k32, v32, attn_mask=kpos[None, :] <= qpos[:, None])
    out.backward(g.float())
    return [out.detach(), q32.grad, k32.grad, v32.grad]


def _err(got, want) -> list[float]:
    return [float((a.float() - b).abs().max() / b.abs().max()) for a, b in zip(got, want)]


def _no_fused(monkeypatch):
    monkeypatch.setattr(fused_blocks, "runs_fused", lambda q: False)


@pytest.mark.parametrize("dtype", LOW)
def test_ring_blocks_on_the_fused_kernel_land_where_the_explicit_blocks_do(dtype, kernel):
    n, L = 4, 256
    q, k, v = _inputs(L, n * L, dtype)
    assert fused_blocks.kind(q, None, "causal") == "causal"      # the fused kernel runs on this device
    if kernel == "flash":
        assert fused_blocks.backend(q) == "flash"
    g = torch.ones(q.shape, device=DEV, dtype=dtype)
    want = _reference(q, k, v, torch.arange((n - 1) * L, n * L, device=DEV), torch.arange(n * L, device=DEV), g)
    with torch.no_grad():
        fused = _err(ring_share(q, k, v, n, fused=True), want)
        explicit = _err(ring_share(q, k, v, n, fused=False), want)
    for what, a, b in zip(("out", "dq", "dk", "dv"), fused, explicit):
        assert a <= 2 * b + 1e-2, f"{dtype} {fused_blocks.backend(q)} {what}: fused {a:.3g}, explicit {b:.3g}"


@pytest.mark.parametrize("dtype", LOW)
def test_the_gather_forms_tiles_on_a_zigzag_rank_equal_one_attention_call(dtype, kernel, monkeypatch):
    n, seq = 4, 1024
    got_err = {}
    for fused in (True, False):
        if not fused:
            _no_fused(monkeypatch)
        for r in (0, n - 1):
            qpos = held(seq, [n], [r], True, device=DEV)
            kpos = held(seq, [n], [r], True, (0,), DEV)
            q, k, v = _inputs(len(qpos), seq, dtype)
            g = torch.randn(q.shape, device=DEV, dtype=dtype)
            want = _reference(q, k, v, qpos, kpos, g)
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            out = _TiledAttention.apply(q, k, v, qpos, kpos, q.shape[-1] ** -0.5)
            out.backward(g)
            got_err[(fused, r)] = _err([out.detach(), q.grad, k.grad, v.grad], want)
    for r in (0, n - 1):
        for what, a, b in zip(("out", "dq", "dk", "dv"), got_err[(True, r)], got_err[(False, r)]):
            assert a <= 2 * b + 1e-2, f"{dtype} {kernel} rank {r} {what}: fused {a:.3g}, explicit {b:.3g}"
