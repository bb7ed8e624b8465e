"""Context-parallel attention in the intra-op problem: its node time and memory under a ``"cp"``
strategy (the model: ``cost_models/context_parallel.py``; the compute of fused tiles:
``cost_models/cp_tiles.py``). ``strategy_prices.node_costs`` calls ``cp_node_time`` and
``cp_saved_bytes``; ``memory_terms`` calls ``cp_transient_bytes``.
"""
from __future__ import annotations

import math

import torch.fx as fx

from autopar.cost_models.causal_attention import is_causal
from autopar.cost_models.compute import OpCost
from autopar.cost_models.context_parallel import CpTime, gather_time, lockstep_time, ring_time
from autopar.cost_models.cp_tiles import AttnShape, cp_compute, prices_tiles, tiled
from autopar.sharding.local_impls import family, local_collectives
from autopar.sharding.placements import local_shape, shard_factor
from autopar.sharding.strategy import Strategy, tensor_inputs

CP_FAMILIES = ("attn_gather", "attn_ring")


def cp_axes(st: Strategy, mesh_shape) -> list[int]:
    """The mesh axes (of size > 1) on which ``st`` runs a context-parallel form, in mesh order."""
    return [a for a, loc in enumerate(st.local) if loc and loc.endswith(":cp") and mesh_shape[a] > 1]


def is_cp(st: Strategy, mesh_shape) -> bool:
    return family(st) in CP_FAMILIES and bool(cp_axes(st, mesh_shape))


def zigzag(st: Strategy, axes: list[int]) -> bool:
    """Whether the queries are split in the zig-zag order (``Z(dim)``) on the cp axes."""
    return any(getattr(st.inputs[0][a], "zigzag", False) for a in axes)


def causal(node: fx.Node) -> bool:
    """Whether the op's own causal flag is set (an explicit mask tensor's pattern is not known)."""
    return is_causal(node)


def tiled_shape(node: fx.Node, st: Strategy, c, grads: bool) -> AttnShape | None:
    """The op's sizes when the runtime runs its cp form as fused tiles and ``cost_models/cp_tiles.py``
    prices them (``tiled``: one cp axis, or a few pieces over several): no mask tensor, no dropout,
    a fused kernel for the device (``c.device``), dtype and head dim, and under the
    gather form a causal mask (without one the gather form calls SDPA once on the gathered keys:
    the even split is what it costs); ``grads``: a backward runs. The batch and heads are one rank's (a
    heads or batch split on other axes divides them), the sequence the whole. None otherwise: the
    balanced-share model."""
    ins = tensor_inputs(node)
    args = list(node.args) + [None] * 8
    dropout = node.kwargs.get("dropout_p", args[4]) or 0.0
    if len(ins) != 3 or dropout or not tiled(tuple(c.mesh_shape[a] for a in cp_axes(st, c.mesh_shape))):
        return None
    q, k, v = (a.meta["val"] for a in ins)
    if not prices_tiles(c.device, q.dtype, int(q.shape[-1])) or (family(st) == "attn_gather" and not causal(node)):
        return None
    lq, lk = (local_shape(t.shape, spec, c.mesh_shape) for t, spec in ((q, st.inputs[0]), (k, st.inputs[1])))
    return AttnShape(math.prod(lq[:-2]), math.prod(lk[:-2]), int(q.shape[-2]), int(q.shape[-1]), int(v.shape[-1]),
                     q.dtype, grads, causal(node))


def cp_time(node: fx.Node, st: Strategy, cost: OpCost, c) -> CpTime:
    """The slowest rank's seconds of ``node`` under the cp strategy ``st``; ``cost``: its per-rank
    cost when the work divides evenly (``strategy_prices.split_cost``); ``c``: the ``Costing``. Where
    the runtime runs fused tiles (``tiled_shape``) the compute is the tiles' (``cost_models/cp_tiles.py``)."""
    axes = cp_axes(st, c.mesh_shape)
    seq = int(tensor_inputs(node)[0].meta["val"].shape[-2])
    pieces = math.prod(c.mesh_shape[a] for a in axes)
    timed = [(kind, nbytes, ax, phase, c.comm(kind, nbytes, ax))
             for kind, nbytes, ax, phase in local_collectives(node, st, c.mesh_shape)]
    gathers = sum(t for kind, _, _, phase, t in timed if kind == "all_gather")
    scatters = sum(t for kind, _, _, phase, t in timed if kind == "reduce_scatter")
    zz = zigzag(st, axes)
    shape = tiled_shape(node, st, c, cost.time_bwd > 0)
    sizes = tuple(c.mesh_shape[a] for a in axes)
    if family(st) == "attn_gather":
        if shape is not None:
            slowest = cp_compute("attn_gather", shape, sizes, zz, c.device)
            return CpTime(slowest.fwd, slowest.bwd, gathers, scatters)
        return gather_time(cost.time_fwd, cost.time_bwd, pieces, seq, causal(node), gathers, scatters, zz)
    n = c.mesh_shape[axes[-1]]
    fwd_hops = [t for kind, _, _, phase, t in timed if kind == "send_recv" and phase == "fwd"]
    bwd_hops = [t for kind, _, _, phase, t in timed if kind == "send_recv" and phase == "bwd"]
    hop_kv = sum(fwd_hops) / max(1, n - 1)
    hop_grad = (sum(bwd_hops) - sum(fwd_hops)) / n if bwd_hops else 0.0   # bwd: K/V hops again, then grads
    overlap = not getattr(c.device, "cores", None)      # accelerators overlap; CPU under gloo does not
    if shape is not None:
        fwd, bwd, fixed = cp_compute("attn_ring", shape, sizes, zz, c.device)
        return lockstep_time(fwd, bwd, hop_kv, hop_grad, overlap, fixed.fwd, fixed.bwd, gathers, scatters)
    return ring_time(cost.time_fwd, cost.time_bwd, n, seq, causal(node), hop_kv, hop_grad, overlap,
                     pieces // n, gathers, scatters, zz)


def cp_node_time(node: fx.Node, st: Strategy, cost: OpCost, c, recomputed: bool) -> float | None:
    """The node's seconds under a cp strategy (compute and its own collectives, the forward again
    when ``recomputed``), or None when ``st`` is not one (``strategy_prices.node_costs`` then costs it)."""
    if not is_cp(st, c.mesh_shape):
        return None
    t = cp_time(node, st, cost, c)
    return t.total + (t.fwd if recomputed else 0.0)


def _kv_local(node: fx.Node, st: Strategy, mesh_shape) -> float:
    """Bytes of this rank's K and V shards together."""
    total = 0.0
    for i in (1, 2):
        v = tensor_inputs(node)[i].meta["val"]
        total += v.numel() / shard_factor(st.inputs[i], mesh_shape) * v.element_size()
    return total


def cp_saved_bytes(node: fx.Node, st: Strategy, c, recomputed: bool = False) -> float:
    """What a cp strategy saves for backward beyond the sequence shards the placements count: the
    gather form's gathered K/V (the other ``pieces - 1`` shards); the ring saves only its own.
    ``recomputed``: the node's forward runs again in backward, so it keeps nothing until then (what its
    region's replay holds while it runs is this with ``recomputed=False``: ``memory_terms``). The one
    rule every caller reads (the solver's node memory, the pipeline's unit profiles, the replay peak)."""
    if recomputed or not is_cp(st, c.mesh_shape) or family(st) != "attn_gather":
        return 0.0
    pieces = math.prod(c.mesh_shape[a] for a in cp_axes(st, c.mesh_shape))
    return _kv_local(node, st, c.mesh_shape) * (pieces - 1)


def cp_transient_bytes(st: Strategy, c, kv: list[tuple[int, float]]) -> float:
    """Workspace of a cp strategy's backward, beyond the op's own gradients: the gather form's
    gradients of the gathered K/V (``pieces`` shards, before the reduce-scatter); the ring's two K/V
    blocks (the one computed on, the one in flight) and two blocks of gradient accumulators (counted
    in the traced dtype). ``kv``: (input index, whole bytes) of the keys and values (inputs 1, 2)."""
    if not is_cp(st, c.mesh_shape):
        return 0.0
    axes = cp_axes(st, c.mesh_shape)
    local = sum(b / shard_factor(st.inputs[i], c.mesh_shape) for i, b in kv if i in (1, 2))
    if family(st) == "attn_gather":
        return local * math.prod(c.mesh_shape[a] for a in axes)
    return 4 * local * math.prod(c.mesh_shape[a] for a in axes[:-1])


__all__ = ["cp_node_time", "cp_saved_bytes", "cp_transient_bytes", "cp_time", "is_cp"]
