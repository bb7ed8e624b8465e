"""Causal attention's work: the share of the ``Sq x Sk`` score entries a causal mask leaves visible.

A fused attention kernel (FlashAttention, the memory-efficient kernel) skips the blocks the causal
mask hides, so ``scaled_dot_product_attention(..., is_causal=True)`` (and its flash / efficient /
CPU variants) does

    visible(Sq, Sk) = sum_{i < Sq} min(Sk, i + 1)       (top-left aligned mask: key j <= query i)
                    = Sq (Sq + 1) / 2                    when Sq <= Sk

of the ``Sq * Sk`` entries, forward and backward: ``causal_fraction`` -> 1/2 for a long square.
``compute.node_work`` scales the op's FLOPs (not its bytes) by it. Under context parallelism
``cost_models/context_parallel.py`` spreads this (already causal) total over the ranks by their
share of the visible entries, so the causal half is counted once.
"""
from __future__ import annotations

import torch.fx as fx


def visible_entries(sq: int, sk: int) -> int:
    """Score entries a top-left causal mask leaves visible for ``sq`` queries and ``sk`` keys."""
    if sq <= sk:
        return sq * (sq + 1) // 2
    return sk * (sk + 1) // 2 + (sq - sk) * sk


def causal_fraction(sq: int, sk: int) -> float:
    """``visible_entries / (sq * sk)`` (1.0 for an empty op)."""
    return visible_entries(sq, sk) / (sq * sk) if sq > 0 and sk > 0 else 1.0


def is_causal(node: fx.Node) -> bool:
    """Whether an attention op node's own ``is_causal`` argument is set (by the op's schema, so the
    flash / efficient / CPU variants, whose flag sits at other positions, are read right)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    for i, arg in enumerate(schema.arguments):
        if arg.name == "is_causal":
            value = node.args[i] if i < len(node.args) else node.kwargs.get("is_causal", arg.default_value)
            return bool(value)
    return False


def causal_scale(node: fx.Node) -> float:
    """The factor on an attention node's FLOPs: ``causal_fraction`` of its query and key lengths when
    it is causal, else 1."""
    if not is_causal(node):
        return 1.0
    q, k = node.args[0], node.args[1]
    try:
        sq, sk = int(q.meta["val"].shape[-2]), int(k.meta["val"].shape[-2])
    except (AttributeError, KeyError, IndexError, TypeError):
        return 1.0
    return causal_fraction(sq, sk)
