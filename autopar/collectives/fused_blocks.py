"""One attention block on torch's fused attention kernels, by device: the tiles of the context-parallel
forms (``attention_cp.py``) that are wholly visible or the square causal block on the diagonal.

A block's forward returns its output, its log-sum-exp over the block's keys (merged across blocks by
the caller) and the kernel's auxiliary outputs; its backward is given the *merged* output and
log-sum-exp, so the kernel's softmax of the block is the one over all keys and the block's
``(dq, dk, dv)`` are its exact shares of the whole op's gradients.

* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (any float dtype).
* CUDA, fp16 / bf16 with a head dim that is a multiple of 8 up to 256, compute capability 8.0 or newer:
  the kernel ``scaled_dot_product_attention`` itself prefers there, cuDNN's
  (``aten._scaled_dot_product_cudnn_attention``) on compute capability 9.0+ with cuDNN SDPA enabled,
  else the flash kernel (``aten._scaled_dot_product_flash_attention``). cuDNN keeps a trailing unit dim
  on its log-sum-exp. The backward gets what autograd would give it after the forward: no cumulative
  sequence tensors (a dense batch), the block's query and key lengths, the forward's random-state
  tensors (unread without dropout), and contiguous rows of the merged output, its log-sum-exp and the
  output's gradient (a strided log-sum-exp view is read as if contiguous: wrong query gradients). Query,
  key and value rows go as sliced (the kernels take strided heads and rows, as SDPA's own calls do).
* Elsewhere (fp32 on CUDA, other devices) ``kind`` returns None and the caller computes the block
  explicitly.
"""
from __future__ import annotations

import torch
from torch.ops import aten


def backend(q: torch.Tensor) -> str | None:
    """"cpu", "cudnn", "flash", or None where blocks of ``q`` have no fused kernel."""
    if q.device.type == "cpu":
        return "cpu"
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    d, cc = q.shape[-1], torch.cuda.get_device_capability(q.device)
    if d % 8 or d > 256 or cc < (8, 0):
        return None
    if cc >= (9, 0) and torch.backends.cuda.cudnn_sdp_enabled():
        return "cudnn"
    flash = torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.is_flash_attention_available()
    return "flash" if flash else None


def runs_fused(q: torch.Tensor) -> bool:
    """Whether blocks of ``q`` can run on a fused kernel of its device."""
    return backend(q) is not None


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
    how = backend(q)
    if how == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(q, kb, vb, 0.0, causal, scale=scale)
        return out, lse, None
    if how == "cudnn":
        out, lse, _, _, _, _, seed, offset, _ = aten._scaled_dot_product_cudnn_attention.default(
            q, kb, vb, None, True, 0.0, causal, False, scale=scale)
        return out, lse.reshape(q.shape[:-1]), ("cudnn", seed, offset, lse.shape)
    out, lse, _, _, _, _, seed, offset, _ = aten._scaled_dot_product_flash_attention.default(
        q, kb, vb, 0.0, causal, False, scale=scale)
    return out, lse, ("flash", seed, offset, lse.shape)


def backward(q, kb, vb, g, out, lse, scale: float, causal: bool, aux):
    """The block's (dq, dk, dv) from the merged output ``out`` and log-sum-exp ``lse`` (``aux``: a
    forward's auxiliary outputs on this device; None on the CPU)."""
    g, out = g.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
    if aux is None:
        return aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            g, q, kb, vb, out, lse.contiguous(), 0.0, causal, scale=scale)
    how, seed, offset, lse_shape = aux
    lq, lk = q.shape[-2], kb.shape[-2]
    if how == "cudnn":
        lse = lse.reshape(q.shape[:-1] + lse_shape[len(q.shape) - 1:]).contiguous()
        return aten._scaled_dot_product_cudnn_attention_backward.default(
            g, q, kb, vb, out, lse, seed, offset, None, None, None, lq, lk, 0.0, causal, scale=scale)[:3]
    return aten._scaled_dot_product_flash_attention_backward.default(
        g, q, kb, vb, out, lse.contiguous(), None, None, lq, lk, 0.0, causal, seed, offset, scale=scale)
