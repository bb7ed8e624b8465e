"""Chunk hints for MoE experts' fused [gate; up] projections (``graph/chunk_hints.py``'s job for the
``autopar::moe_experts`` op): a concatenated ``gate_up_proj`` (and its bias) is split block-wise
under expert tensor parallelism (``sharding/rules/moe.py``: ``Shard(dim, chunks=2)``), so its
placeholder is tagged ``meta["chunk_hint"] = 2`` and may be stored in that layout (no gather)."""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.frontend.moe_experts import registered

MOE_OP = "autopar::moe_experts"
FUSED = ("gate_up_proj", "gate_up_proj_bias")


def _is_moe(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target.name() == MOE_OP


def _source(node):
    """The placeholder behind ``node`` through ops with one node input (a cast, a view), or None."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        ins = [a for a in node.args if isinstance(a, fx.Node)]
        if len(ins) != 1:
            return None
        node = ins[0]
    return node if isinstance(node, fx.Node) and node.op == "placeholder" else None


def mark_moe_chunk_hints(gm: fx.GraphModule) -> int:
    """Tag the fused gate/up parameters of every concatenated-layout experts op; returns how many."""
    marked = 0
    for node in gm.graph.nodes:
        if not _is_moe(node):
            continue
        e = registered(node.args[0])
        if e is None or not (e.has_gate and e.is_concatenated):
            continue
        for name, p in zip(e.param_names, node.args[4]):
            src = _source(p) if name in FUSED else None
            if src is not None:
                src.meta["chunk_hint"] = 2
                marked += 1
    return marked
