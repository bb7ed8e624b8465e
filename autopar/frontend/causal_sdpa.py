"""Hugging Face SDPA attention traced as one process runs it: ``is_causal``, no materialised mask.

With ``attn_implementation="sdpa"``, no padding mask, positions counted from 0 and as many queries as
keys, ``transformers`` builds no causal mask in one process: ``masking_utils.find_packed_sequence_indices``
finds one sequence per row (returns None), ``_ignore_causal_mask_sdpa`` says the mask can be skipped,
and the attention calls ``scaled_dot_product_attention(q, k, v, is_causal=True)`` (the fused, flash
kernel on a GPU). Under ``torch.export`` both refuse to look: the positions are fake tensors, and an
exported program may later run at other lengths. autopar's graphs are specialised to the traced
shapes (``static_shapes.py``), so the trace would carry a materialised ``batch x 1 x seq x seq``
boolean mask instead, send it across every pipeline cut, and cost the attention as if it read it.

``causal_sdpa_without_mask()`` answers both questions as one process does where the answer needs no
input's value:

* positions computed from constants alone (the model's own ``arange``, not a ``position_ids``
  input): their graph ancestry is replayed on real CPU tensors and ``transformers``' own check runs
  on the result;
* the skip, for no padding mask, integer offsets and no local window.

Anything else (positions or a mask given as inputs, sliding windows) defers to ``transformers``.
"""
from __future__ import annotations

import contextlib

import torch
import torch.fx as fx

_MAX_REPLAY = 1 << 26      # elements: positions are batch x seq integers; refuse anything larger


def _plain_skip(padding_mask, q_length, kv_length, q_offset, kv_offset=0, local_attention_size=None) -> bool | None:
    """One process's answer where it needs no tensor value, else None (defer)."""
    if padding_mask is not None or not isinstance(q_offset, int) or not isinstance(kv_offset, int):
        return None
    if local_attention_size is not None and kv_length >= local_attention_size:
        return None
    if q_length == 1 or kv_length == q_length:
        return True
    return None


def _ancestry(node: fx.Node) -> list[fx.Node] | None:
    """``node`` and the nodes it is computed from, in graph order; None if any is an input or an
    attribute (the value is not a function of constants) or too large to replay."""
    seen: dict[fx.Node, None] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        val = n.meta.get("val")
        if n.op != "call_function" or (isinstance(val, torch.Tensor) and val.numel() > _MAX_REPLAY):
            return None
        seen[n] = None
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _on_cpu(value):
    return torch.device("cpu") if isinstance(value, torch.device) else value


def constant_value(t: torch.Tensor) -> torch.Tensor | None:
    """The real value of a tensor being traced, when the trace computed it from constants alone."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    slot = get_proxy_slot(t, mode.tracer, None) if mode is not None else None
    nodes = _ancestry(slot.proxy.node) if slot is not None else None
    if nodes is None:
        return None
    values: dict[fx.Node, object] = {}
    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        for n in nodes:
            args = fx.node.map_arg(n.args, values.__getitem__)
            kwargs = {k: _on_cpu(v) for k, v in fx.node.map_arg(n.kwargs, values.__getitem__).items()}
            try:
                values[n] = n.target(*args, **kwargs)
            except Exception:  # noqa: BLE001 - not replayable on the CPU: defer
                return None
    out = values[nodes[-1]]
    return out if isinstance(out, torch.Tensor) else None


def _one_sequence_per_row(find_packed, positions: torch.Tensor) -> bool:
    """``transformers``' own test on real positions (its ``is_tracing`` guard would refuse to look
    while an export is active, so its last step is repeated here)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        seq = find_packed(positions)
        return seq is None or bool((seq[:, -1] == 0).all())


@contextlib.contextmanager
def causal_sdpa_without_mask():
    """While active, ``transformers``' packed-sequence check and SDPA mask skip answer as in one
    process where their inputs are constants or absent."""
    try:
        from transformers import masking_utils
    except Exception:  # noqa: BLE001 - no transformers, nothing to patch
        yield
        return
    skip_orig = getattr(masking_utils, "_ignore_causal_mask_sdpa", None)
    packed_orig = getattr(masking_utils, "find_packed_sequence_indices", None)
    if skip_orig is None or packed_orig is None:
        yield
        return

    def skip(padding_mask, q_length, kv_length, q_offset, kv_offset, *args, **kwargs):
        answer = _plain_skip(padding_mask, q_length, kv_length, q_offset, kv_offset, *args, **kwargs)
        return skip_orig(padding_mask, q_length, kv_length, q_offset, kv_offset, *args, **kwargs) if answer is None \
            else answer

    def packed(position_ids):
        real = constant_value(position_ids)
        if real is not None and _one_sequence_per_row(packed_orig, real):
            return None
        return packed_orig(position_ids)

    masking_utils._ignore_causal_mask_sdpa = skip
    masking_utils.find_packed_sequence_indices = packed
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa = skip_orig
        masking_utils.find_packed_sequence_indices = packed_orig
