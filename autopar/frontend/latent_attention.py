"""Multi-head latent attention (DeepSeek-V2/V3 in Hugging Face ``transformers``) traced as it runs.

Such a module expands its compressed latent into keys and values for EVERY head (``kv_b_proj`` has
``num_heads * (qk_nope_head_dim + v_head_dim)`` outputs), yet it keeps the config's
``num_key_value_groups = num_attention_heads // num_key_value_heads``. With
``num_key_value_heads < num_attention_heads`` the attention function would repeat those keys again.
One process never does: without a mask the sdpa path calls ``scaled_dot_product_attention(...,
enable_gqa=True)``, which, with equal head counts, is plain attention. Under ``torch.export`` a
causal mask is built wherever ``transformers`` cannot skip it (``frontend/causal_sdpa.py`` lets it skip
where one process does; a padding mask still builds one), which sends the call to ``repeat_kv`` and a
head-count mismatch (``Attempting to broadcast a dimension of length 8``). ``latent_attention_groups(model)`` sets such modules' ``num_key_value_groups`` to 1
for the trace (what the one-process run computes: every key head is used once) and restores it.
"""
from __future__ import annotations

import contextlib

import torch.nn as nn


def _keys_have_every_head(m: nn.Module) -> bool:
    kv_b, heads = getattr(m, "kv_b_proj", None), getattr(m, "num_heads", None)
    nope, v = getattr(m, "qk_nope_head_dim", None), getattr(m, "v_head_dim", None)
    if not (isinstance(kv_b, nn.Linear) and all(isinstance(x, int) for x in (heads, nope, v))):
        return False
    return kv_b.out_features == heads * (nope + v)


@contextlib.contextmanager
def latent_attention_groups(model: nn.Module):
    """While active, latent-attention modules whose keys already carry every head repeat none."""
    changed = []
    for m in model.modules():
        groups = getattr(m, "num_key_value_groups", None)
        if isinstance(groups, int) and groups > 1 and _keys_have_every_head(m):
            changed.append((m, groups))
            m.num_key_value_groups = 1
    try:
        yield
    finally:
        for m, groups in changed:
            m.num_key_value_groups = groups
