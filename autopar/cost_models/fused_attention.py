"""Attention whose query/key head dim differs from the value's, on a GPU: costed as the fused kernel.

DeepSeek-V3's multi-head latent attention calls ``scaled_dot_product_attention`` with query/key heads
of 192 (128 + 64 rotary) and value heads of 128. The work of an op is counted by running it on fake
CPU tensors (``compute._work``), and CPU SDPA takes unequal head dims only in its math decomposition:
16 kernels forward that materialise the B x H x S x S scores (70 GB of traffic for one 4096-token
sequence of 128 heads), ~43 ms on an H800 preset where the equal-dims kernel costs ~3 ms. That is
what the CPU runtime runs, so the CPU device keeps it. On CUDA the memory-efficient and cuDNN
kernels accept a value head dim other than the query's (only flash needs them equal), so a GPU
device costs such an SDPA as every fused one is costed (the equal-dims path's numbers): the formula's
FLOPs at the causal share, the bytes of q, k, v and the output forward and twice that backward
(their gradients), one kernel each way. What it saves for backward is the fused kernel's already
(``save_rules._sdpa``: q, k, v, output, logsumexp).
"""
from __future__ import annotations

import torch
import torch.fx as fx


def _nbytes(v) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def fused_sdpa_numbers(node: fx.Node, backward: bool, causal: float) -> dict | None:
    """``compute.OpWork``'s fields of the fused kernel running ``node`` (``backward``: it has a backward;
    ``causal``: the share of visible score entries); None when the shapes are unknown."""
    try:
        q, k, v = (a.meta["val"] for a in node.args[:3])
        out = node.meta["val"]
        batch = q.numel() // (q.shape[-2] * q.shape[-1])
        sq, d, sk, dv = int(q.shape[-2]), int(q.shape[-1]), int(k.shape[-2]), int(v.shape[-1])
    except (AttributeError, KeyError, IndexError, TypeError, ZeroDivisionError):
        return None
    fwd = (2.0 * batch * sq * sk * d + 2.0 * batch * sq * sk * dv) * causal
    moved = float(_nbytes(q) + _nbytes(k) + _nbytes(v) + _nbytes(out))
    return dict(flops_fwd=fwd, flops_bwd=2.0 * fwd if backward else 0.0, bytes_fwd=moved,
                bytes_bwd=2.0 * moved if backward else 0.0, kernels_fwd=1, kernels_bwd=1 if backward else 0)


def costs_fused(device) -> bool:
    """Whether ``device`` runs unequal-head-dim SDPA fused (every preset but the CPU)."""
    return getattr(device, "name", "cpu") != "cpu"
