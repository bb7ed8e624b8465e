"""scaled_dot_product_attention: split batch or heads (the mask follows where it has the dim;
with ``enable_gqa`` query and key heads split in equal blocks), or the sequence (context parallelism, strategy name ``"cp"``).

Sequence split: queries, keys and values split along their sequence dim over the axis, the
output split like the queries; a mask splits its query dim and keeps its key dim whole. Two
local implementations (``collectives/attention_cp.py``), both exact in forward and backward:

* ``attn_gather:cp`` (Llama 3's): all-gather K and V, attend with this rank's queries under
  the causal mask offset by their positions; backward reduce-scatters the K/V gradients.
* ``attn_ring:cp`` (ring attention): K/V blocks pass around the ring, merged by log-sum-exp;
  the backward passes them again with their gradients. Holds one block at a time, never the
  whole K/V.

They are two families so that one node never mixes them across axes; the solver picks by the
cost of the collectives ``sharding/local_impls.py`` lists for each.
"""
from __future__ import annotations

from torch.ops import aten

from autopar.sharding.placements import R, Shard
from autopar.sharding.registry import register_rule
from autopar.sharding.strategy import AxisStrategy, shape_of, tensor_inputs

CP_FORMS = ("attn_gather:cp", "attn_ring:cp")


@register_rule(aten.scaled_dot_product_attention.default)
def sdpa(node):
    ins = tensor_inputs(node)
    q, k = shape_of(ins[0]), shape_of(ins[1])
    gqa = bool(node.kwargs.get("enable_gqa", False))
    opts = []
    for d in range(len(q) - 2):
        if d == len(q) - 3 and q[d] != k[d] and not gqa:
            continue  # heads broadcast: keep them whole
        # enable_gqa: query head i reads key head i // (Hq / Hk), so equal blocks of both stay together
        pl = []
        for a in ins:
            s = shape_of(a)
            j = d - (len(q) - len(s))
            pl.append(Shard(j) if j >= 0 and s[j] != 1 else R)
        opts.append(AxisStrategy(tuple(pl), Shard(d), None, "heads" if d == len(q) - 3 else f"S{d}"))
    return opts + _sequence(ins, _dropout(node))


def _dropout(node) -> float:
    return node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)


def _sequence(ins, dropout: float = 0.0) -> list[AxisStrategy]:
    """Queries, keys, values split along the sequence (dim -2); a mask along its query dim. The
    ring form is not offered with dropout (its blocks would need the whole row's mask)."""
    q = shape_of(ins[0])
    if len(q) < 2 or len(ins) < 3 or any(len(shape_of(a)) < 2 for a in ins[:3]):
        return []
    pl = [Shard(len(q) - 2), Shard(len(shape_of(ins[1])) - 2), Shard(len(shape_of(ins[2])) - 2)]
    for m in ins[3:]:
        s = shape_of(m)
        pl.append(Shard(len(s) - 2) if len(s) >= 2 and s[-2] != 1 else R)
    forms = CP_FORMS if not dropout else CP_FORMS[:1]
    return [AxisStrategy(tuple(pl), Shard(len(q) - 2), form, "cp") for form in forms]
