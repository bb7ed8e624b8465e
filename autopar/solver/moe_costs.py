"""The intra-op problem's prices of an ``autopar::moe_experts`` node under one strategy
(``cost_models/moe.py`` has the formulas): its compute on one rank and its dispatch all-to-alls,
each at the load imbalance where the experts are split (``Costing.moe_imbalance``)."""
from __future__ import annotations

import dataclasses
import math

import torch.fx as fx

from autopar.cost_models.compute import OpCost, OpWork, cost_from_work, node_work
from autopar.cost_models.moe import (DISPATCH_BWD_KERNELS, KEEP_KERNELS, SPLIT_KERNELS, MoeShape, dispatch_kernels,
                                    etp_split, expert_split_axes, local_rows_per_expert, moe_kernels)
from autopar.sharding.strategy import Strategy


def moe_split_cost(node: fx.Node, base: OpCost, st: Strategy, f: int, c) -> OpCost:
    """One rank's cost: the work over ``f`` (``strategy_prices.work_split``), its GEMMs at the local rows per
    expert (``cost_models.moe.local_rows_per_expert``) and intermediate dim (``etp_split``), the launches
    of its own experts and its dispatch where they are split (``_launches``), times
    ``c.moe_imbalance`` (launches excluded) where the experts are split."""
    if f <= 1:
        return base
    work = node_work(node)
    shape = MoeShape(node)
    rows = local_rows_per_expert(node, st.inputs, c.mesh_shape)
    dim = shape.gemm_dim(rows, etp_split(st.local, c.mesh_shape))
    kernels = _launches(shape, st, c.mesh_shape, work)
    local = OpWork(work.flops_fwd / f, work.flops_bwd / f, work.bytes_fwd / f, work.bytes_bwd / f,
                   kernels[0], kernels[1] if work.kernels_bwd else 0,
                   tuple((dim, fl / f) for _, fl in work.matmuls_fwd), tuple((dim, fl / f) for _, fl in work.matmuls_bwd))
    cost = cost_from_work(local, c.device, base_dtype(node))
    k = c.moe_imbalance if expert_split_axes(st.local, c.mesh_shape) else 1.0
    if k == 1.0:
        return cost
    return dataclasses.replace(cost, time_fwd=(cost.time_fwd - cost.launch_fwd) * k + cost.launch_fwd,
                               time_bwd=(cost.time_bwd - cost.launch_bwd) * k + cost.launch_bwd)


def _launches(shape: MoeShape, st: Strategy, mesh_shape, work: OpWork) -> tuple[int, int]:
    """(forward, backward) kernels on one rank: where the experts are split, those of its own ``E_local``
    experts plus each ep hop's dispatch (``cost_models.moe.dispatch_kernels``); else the whole op's."""
    held = math.prod(mesh_shape[a] for a in expert_split_axes(st.local, mesh_shape))
    if held <= 1:
        return work.kernels_fwd, work.kernels_bwd
    roles = [(mesh_shape[a], loc.split(":")[-1]) for a, loc in enumerate(st.local)
             if loc and loc.split(":")[0] == "moe" and mesh_shape[a] > 1]
    hops = [n for n, role in roles if role == "ep"]
    keep = any(role == "experts" for _, role in roles)
    own = moe_kernels(max(1, shape.experts // held))
    fwd = own + SPLIT_KERNELS[0] + sum(dispatch_kernels(n) for n in hops) + (KEEP_KERNELS[0] if keep else 0)
    bwd = 2 * own + SPLIT_KERNELS[1] + DISPATCH_BWD_KERNELS * len(hops) + (KEEP_KERNELS[1] if keep else 0)
    return fwd, bwd


def base_dtype(node: fx.Node):
    return node.args[1].meta["val"].dtype


def imbalanced_dispatch(colls: list[tuple], st: Strategy, c) -> list[tuple]:
    """``(kind, bytes, axis, phase, seconds)`` entries with each all-to-all on an axis that splits the
    experts charged ``c.moe_imbalance`` times its seconds (the busiest rank's share)."""
    axes = set(expert_split_axes(st.local, c.mesh_shape))
    k = c.moe_imbalance
    return [(kind, nb, ax, ph, t * k if kind == "all_to_all" and ax in axes else t) for kind, nb, ax, ph, t in colls]
