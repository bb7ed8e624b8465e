"""One attention block on torch's fused flash kernel, by device: the tiles of the context-parallel
forms (``attention_cp.py``) that are wholly visible or the square causal block on the diagonal.

A block's forward returns its output, its log-sum-exp over the block's keys (merged across blocks
by the caller) and the kernel's auxiliary outputs; its backward is given the *merged* output and
log-sum-exp, so the kernel's softmax of the block is the one over all keys and the block's
``(dq, dk, dv)`` are its exact shares of the whole op's gradients.

* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (any float dtype).
* CUDA: ``aten._scaled_dot_product_flash_attention`` and its backward, where the flash kernel runs
  (fp16 / bf16, a head dim that is a multiple of 8 up to 256, compute capability 8.0 or newer, flash
  SDPA enabled). The backward gets what autograd would give it after the forward: no cumulative
  sequence tensors (a dense batch), the block's query and key lengths, the forward's random-state
  tensors (unread without dropout), and contiguous rows of the merged output, its log-sum-exp and
  the output's gradient (a strided log-sum-exp view is read as if contiguous: wrong query gradients).
  Elsewhere (fp32 on CUDA, other devices) ``kind`` returns None and the caller computes the block
  explicitly.
"""
from __future__ import annotations

import torch
from torch.ops import aten


def runs_fused(q: torch.Tensor) -> bool:
    """Whether blocks of ``q`` can run on the fused kernel of its device."""
    if q.device.type == "cpu":
        return True
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    d = q.shape[-1]
    return (d % 8 == 0 and d <= 256 and torch.backends.cuda.flash_sdp_enabled()
            and torch.backends.cuda.is_flash_attention_available()
            and torch.cuda.get_device_capability(q.device) >= (8, 0))


def kind(q, mask, tile: str) -> str | None:
    """How the fused kernel can run a tile of kind ``tile`` (``cp_positions.tiles``): ``"full"`` (every
    key visible, no mask), ``"causal"`` (the square block on the diagonal: ``is_causal`` as torch aligns
    it) or None (a mask, a partly visible tile, or a device / dtype without the kernel: the explicit
    path)."""
    if mask is not None or tile not in ("full", "causal") or not runs_fused(q):
        return None
    return tile


def forward(q, kb, vb, scale: float, causal: bool):
    """(out, log-sum-exp over the block's keys, auxiliary outputs for ``backward``) of one block."""
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(q, kb, vb, 0.0, causal, scale=scale)
        return out, lse, None
    out, lse, _, _, _, _, seed, offset, _ = aten._scaled_dot_product_flash_attention.default(
        q.contiguous(), kb.contiguous(), vb.contiguous(), 0.0, causal, False, scale=scale)
    return out, lse, (seed, offset)


def backward(q, kb, vb, g, out, lse, scale: float, causal: bool, aux):
    """The block's (dq, dk, dv) from the merged output ``out`` and log-sum-exp ``lse`` (``aux``: a
    forward's auxiliary outputs on this device; None on the CPU)."""
    g, out, lse = g.to(q.dtype).contiguous(), out.to(q.dtype).contiguous(), lse.contiguous()
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            g, q, kb, vb, out, lse, 0.0, causal, scale=scale)
    seed, offset = aux
    return aten._scaled_dot_product_flash_attention_backward.default(
        g, q.contiguous(), kb.contiguous(), vb.contiguous(), out, lse, None, None, q.shape[-2], kb.shape[-2], 0.0,
        causal, seed, offset, scale=scale)
