"""The intra-op problem's prices: what each candidate strategy of a node, and each pair of strategies
on an edge, costs in seconds and bytes (``problem.build_problem`` assembles them into the ILP).

node cost c[v,s]   = (compute(v) - launches) / work_split(s) + launches   (``split_cost``;
                       matmuls costed on their local shapes)
                     + backward all-reduce of each Replicate input that s uses split
                       (Megatron's ``f``; for parameters this is the gradient sync)
                     + the small collectives of s's local implementation (vocab-parallel
                       loss, synced batch-norm statistics)
                     context-parallel attention instead: its slowest rank's work and the
                       collectives it does not hide (``cp_costs.py``)
node memory m[v,s] = parameters: training-state bytes (weights, grads, optimizer; in the
                       parameter's dtype unless mixed precision) / shard factor
                     saved graph tensors charged to v / shard factor of v's output
                     + tensors v makes and saves itself (log-probs, statistics, masks)
                       / shard factor of v's first input or output, the larger  (``local_saved``)
edge cost R[u,v]   = redistribution of u's output spec into v's required input spec,
                     forward collectives plus their conjugates in backward  (``edge_cost``),
                     less, where it ends in an all-gather on an axis v runs split, v's backward
                     all-reduce there minus the reduce-scatter the gather's backward becomes
                     (Megatron-SP, ``seq_parallel.fused_gather_saving``)
edge memory G[u,v] = a parameter u that v takes in another placement than the stored one and
                     saves for backward: the gathered copy's bytes  (``gathered_matrix``;
                     per edge, so two consumers saving the same copy are both charged);
                     an activation v saves gathered: its share of the copy beyond u's piece
                     (``seq_parallel.with_gathered_copies``, added by ``problem.build_problem``)

Gradient sync is bucketed at run time: a parameter of n bytes pays the bandwidth in full and
``n / GRAD_BUCKET_BYTES`` of a latency (``Costing.grad_sync``; the last bucket: ``grad_sync_overhead``).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx as fx

from autopar.core import search_memo
from autopar.cost_models.comm import GRAD_BUCKET_BYTES, axis_collective_time, bucketed_collective_time
from autopar.cost_models.compute import OpCost, local_node_cost, node_signature
from autopar.graph.grads import grad_nodes, is_parameter
from autopar.cost_models.memory import training_state_parts
from autopar.cost_models.moe import DEFAULT_IMBALANCE, is_moe
from autopar.cost_models.node_cost_memo import cached_node_cost, node_cost_table
from autopar.cost_models.param_step import optimizer_step_time, working_copy_time
from autopar.cost_models.zero import sharded_state, zero_axes
from autopar.sharding.candidates import Candidates
from autopar.sharding.local_impls import local_collectives
from autopar.sharding.placements import Replicate, local_shape, shard_factor
from autopar.sharding.redistribute import backward_kind, cached_steps, step_bytes
from autopar.sharding.strategy import Strategy, tensor_inputs
from autopar.solver.cp_costs import cp_node_time, cp_saved_bytes
from autopar.solver.moe_costs import imbalanced_dispatch, moe_split_cost
from autopar.solver.seq_parallel import fused_gather_saving
from autopar.solver.spec_rows import SpecRow, spec_row
from autopar.solver.intra_op import HUGE_COST, EdgeCost


@dataclass
class Costing:
    """What the cost functions need to know about the mesh and the training setup."""

    mesh_shape: tuple
    device: object                  # DeviceSpec
    optimizer: str = "adamw"
    precision: str = "fp32"
    frozen_buffers: set = field(default_factory=set)   # placeholders that must never be redistributed
    recompute: str | dict = "none"  # activation recomputation: its forward runs again, its saves are dropped
    zero: int = 0                   # ZeRO stage over the axes a parameter is replicated on
    grad_element_bytes: int | None = None   # bytes per gradient element as synced (``sync_element_bytes``)
    microbatches: int = 1           # microbatches per step (accumulation or a pipeline's): the gradients of
                                    # the earlier ones are held while a later one's are computed
    moe_imbalance: float = DEFAULT_IMBALANCE   # busiest expert rank's load over the mean (cost_models/moe.py)
    _redistribution: dict = field(default_factory=dict, repr=False)  # (src, dst, bytes) -> seconds
    _memo: dict = field(default_factory=dict, repr=False)  # node costs, edge lists of one graph (``build_problem``)
    _tables: dict = field(default_factory=dict, repr=False)  # edge resharding tables and gathered-copy matrices,
                                    # keyed by value (specs, bytes), not by node
    _comm: dict = field(default_factory=dict, repr=False)   # (kind, bytes, axis) -> seconds (``comm``)

    def inner(self, axis: int) -> int:
        return math.prod(self.mesh_shape[axis + 1:])

    def comm(self, kind: str, nbytes: float, axis: int) -> float:
        """Seconds of one ``kind`` collective of ``nbytes`` over ``axis`` (memoised per costing under
        ``search_memo``: a pure function of its arguments, asked ~a million times per search)."""
        if kind in ("local_slice", "to_partial") or nbytes <= 0:
            return 0.0
        if not search_memo.ENABLED:
            return axis_collective_time(kind, nbytes, self.device, self.mesh_shape[axis], self.inner(axis))
        key = (kind, nbytes, axis)
        t = self._comm.get(key)
        if t is None:
            t = self._comm[key] = axis_collective_time(kind, nbytes, self.device, self.mesh_shape[axis],
                                                       self.inner(axis))
        return t

    def latency(self, axis: int) -> float:
        """The size-independent part of an all-reduce over ``axis``."""
        return self.comm("all_reduce", 1.0, axis)

    def grad_sync(self, nbytes: float, axis: int) -> float:
        """One parameter's share of the bucketed gradient sync over ``axis`` (module docstring): an
        all-reduce, or under ZeRO the reduce-scatter into the shards (``runtime/zero.py``)."""
        return self.bucketed("reduce_scatter" if self.zero else "all_reduce", nbytes, axis)

    def grad_bytes(self, node: fx.Node) -> float:
        """Bytes of a parameter's gradient as the sync moves it (the whole tensor; callers divide
        by its shards)."""
        v = node.meta.get("val")
        if self.grad_element_bytes and isinstance(v, torch.Tensor):
            return float(v.numel() * self.grad_element_bytes)
        return tensor_bytes(node)

    def bucketed(self, kind: str, nbytes: float, axis: int) -> float:
        """One tensor's share of a bucketed ``kind`` collective over ``axis`` (``comm.bucketed_collective_time``)."""
        return bucketed_collective_time(kind, nbytes, self.device, self.mesh_shape[axis], self.inner(axis))


def sync_element_bytes(precision: str, grad_compression: str | None) -> int | None:
    """Bytes per gradient element the data-parallel sync moves: 2 with ``grad_compression``, 4 under
    bf16 mixed precision (fp32 gradients of the fp32 masters, ``reduce_dtype`` fp32), else None: the
    traced parameter's own dtype."""
    if grad_compression in ("bf16", "fp16"):
        return 2
    return 4 if precision == "mixed" else None


def grad_sync_overhead(c: Costing, synced: Iterable[tuple[int, float]]) -> float:
    """Latency of each axis's last gradient bucket, paid once per step: ``synced`` lists
    (axis, bytes) of every parameter gradient all-reduced after backward."""
    total: dict[int, float] = {}
    for axis, nbytes in synced:
        total[axis] = total.get(axis, 0.0) + nbytes
    return sum(c.latency(a) * (math.ceil(b / GRAD_BUCKET_BYTES) - b / GRAD_BUCKET_BYTES)
               for a, b in total.items() if b > 0)


def tensor_bytes(node: fx.Node, index: int | None = None) -> float:
    v = node.meta.get("val")
    if index is not None and isinstance(v, (tuple, list)):
        v = v[index]
    return float(v.numel() * v.element_size()) if isinstance(v, torch.Tensor) else 0.0


def redistribution_time(src, dst, nbytes: float, c: Costing, grad: bool = True) -> float:
    """Forward steps plus, when the value needs a gradient (``grad``), the conjugate collectives
    autograd runs in backward (memoised)."""
    key = (src, dst, nbytes, grad)
    if key not in c._redistribution:
        c._redistribution[key] = _redistribution_time(src, dst, nbytes, c, grad)
    return c._redistribution[key]


def _redistribution_time(src, dst, nbytes: float, c: Costing, grad: bool = True) -> float:
    total, local = 0.0, nbytes / shard_factor(src, c.mesh_shape)
    for st in cached_steps(src, dst):
        moved, local_after = step_bytes(st, local, c.mesh_shape)
        total += c.comm(st.kind, moved, st.axis)
        bwd = backward_kind(st.kind) if grad else None
        if bwd:
            total += c.comm(bwd, moved, st.axis)
        local = local_after
    return total


def _redistribution_by_ids(si: int, di: int, src, dst, nbytes: float, c: Costing, grad: bool) -> float:
    """``_redistribution_time(src, dst, nbytes, c, grad)`` with the steps and the source's shard factor
    kept per pair of spec numbers (``edge_cost``'s ``spec ids``): the same arithmetic in the same order,
    without hashing the specs for every byte count."""
    plans = c._tables.setdefault("steps by spec ids", {})
    plan = plans.get((si, di))
    if plan is None:
        plan = plans[(si, di)] = (shard_factor(src, c.mesh_shape), tuple(
            (st, backward_kind(st.kind)) for st in cached_steps(src, dst)))
    factor, steps = plan
    total, local = 0.0, nbytes / factor
    for st, bwd in steps:
        moved, local_after = step_bytes(st, local, c.mesh_shape)
        total += c.comm(st.kind, moved, st.axis)
        if grad and bwd:
            total += c.comm(bwd, moved, st.axis)
        local = local_after
    return total


def strategy_outputs(st: Strategy) -> list:
    o = st.output
    return list(o) if o and isinstance(o[0], tuple) else [o]


def work_split(st: Strategy, mesh_shape) -> int:
    specs = list(st.inputs) + strategy_outputs(st)
    return max([shard_factor(s, mesh_shape) for s in specs] + [1])


def split_cost(node: fx.Node, base: OpCost, st: Strategy, ins: list[fx.Node], c: Costing) -> OpCost:
    """One rank's cost of ``node`` under ``st``: the work divided by :func:`work_split`, kernel
    launches not divided (``OpCost.scaled``); a matmul is costed on its local shapes instead,
    since its efficiency follows its smallest local dimension."""
    f = work_split(st, c.mesh_shape)
    if is_moe(node):
        return moe_split_cost(node, base, st, f, c)
    if f <= 1:
        return base
    shapes = {a: local_shape(a.meta["val"].shape, spec, c.mesh_shape) for a, spec in zip(ins, st.inputs)}
    local = local_node_cost(node, shapes, c.device)
    if local is not None and math.isclose(local.flops_fwd * f, base.flops_fwd, rel_tol=0.02):
        return local
    return base.scaled(f)


def split_axes(st: Strategy) -> set[int]:
    """Axes on which some output is not Replicate: R inputs there get partial gradients."""
    axes = set()
    for o in strategy_outputs(st):
        for a, p in enumerate(o):
            if not isinstance(p, Replicate):
                axes.add(a)
    return axes


def grad_sync_inputs(st: Strategy) -> list[tuple[int, int]]:
    """(input index, axis) pairs whose gradient needs an all-reduce over the axis."""
    axes = split_axes(st)
    return [(i, a) for i, spec in enumerate(st.inputs) for a in axes if isinstance(spec[a], Replicate)]


def local_impl_times(node: fx.Node, st: Strategy, c: Costing) -> list[tuple[str, float, int, str, float]]:
    """(kind, bytes, axis, phase, seconds) of each collective of ``st``'s local implementation
    (``sharding/local_impls.py``), forward and backward: the list the plan shows, with the times the
    ILP charges (an MoE dispatch's all-to-alls at the load imbalance, ``solver/moe_costs.py``)."""
    out = [(kind, nbytes, ax, phase, c.comm(kind, nbytes, ax))
           for kind, nbytes, ax, phase in local_collectives(node, st, c.mesh_shape)]
    if out and is_moe(node):
        out = imbalanced_dispatch(out, st, c)
    return out


def _local_impl_time(node: fx.Node, st: Strategy, c: Costing, again: bool = False) -> float:
    """The seconds of ``local_impl_times``; ``again``: the node is recomputed, its forward
    collectives run once more in backward (``solver/recompute_collectives.py``)."""
    return sum(t * (2 if again and phase == "fwd" else 1) for _k, _b, _a, phase, t in local_impl_times(node, st, c))


def _param_state_cost(numel: float, parts: list[float], st: Strategy, c: Costing) -> tuple[float, float, float]:
    """(bytes, seconds, of which once per step) of one parameter's local piece of ``numel`` elements and (weights,
    gradients, optimizer state) bytes ``parts``: its training state and optimizer step, under
    ``c.zero`` sharded over the ``d`` ranks of the axes it is replicated on (``cost_models/zero.py``:
    the state divides stage by stage, the step by ``d``). ZeRO's reduce-scatter is costed by the
    consumers' gradient sync (``Costing.grad_sync``); its weight all-gathers, bucketed too (by
    25 MB for stages 1, 2, by layer for stage 3), are added: one after the optimizer step
    (stages 1, 2), one before the layer's forward and one before its backward (stage 3). Only
    stage 3's gathers run in every microbatch, as does the mixed-precision working copy's cast
    (``param_step.working_copy_time``)."""
    cast = working_copy_time(numel, c.device, c.precision)     # every microbatch: the mixed-precision working copy
    if not c.zero:
        step = optimizer_step_time(numel, c.device, 1, c.optimizer)
        return sum(parts), step + cast, step
    axes, d = zero_axes(st.output, c.mesh_shape)
    gathers = 2 if c.zero == 3 else 1
    step = optimizer_step_time(numel / d, c.device, 1, c.optimizer)
    gathered = gathers * sum(c.bucketed("all_gather", parts[0], a) for a in axes)
    return sharded_state(*parts, d, c.zero), step + gathered + cast, step + (0.0 if c.zero == 3 else gathered)


def node_costs(node: fx.Node, strategies: list[Strategy], c: Costing, saved: dict,
               traced_params: set[str], recomputed: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per strategy: seconds (compute, own collectives, gradient sync; + the forward again when
    ``recomputed``), the bytes the node keeps (training state, or saved activations), and the
    part of the seconds that runs once per step however many microbatches accumulate (gradient
    sync of parameters, the optimizer step, ZeRO-1/2's weight gathers; ``accumulation.py``)."""
    k = len(strategies)
    compute, memory, once = np.zeros(k), np.zeros(k), np.zeros(k)
    if node.op == "placeholder":
        if node.name in traced_params:
            v = node.meta["val"]
            parts = training_state_parts(v.numel(), v.dtype, c.optimizer, c.precision)
            for s, st in enumerate(strategies):
                shards = shard_factor(st.output, c.mesh_shape)
                memory[s], compute[s], once[s] = _param_state_cost(v.numel() / shards, [p / shards for p in parts],
                                                                   st, c)
        return compute, memory, once
    base = cached_node_cost(node_cost_table(node.graph, c.device), node, c.device)
    need = grad_nodes(node.graph)
    ins = tensor_inputs(node)
    for s, st in enumerate(strategies):
        cost = split_cost(node, base, st, ins, c)
        cp = cp_node_time(node, st, cost, c, recomputed)     # context-parallel attention: solver/cp_costs.py
        compute[s] = cost.time_total + (cost.time_fwd if recomputed else 0.0) if cp is None else cp
        for i, a in grad_sync_inputs(st):
            if ins[i] not in need:
                continue
            # consumers needing the same gradient all-reduce share one (the pass emits one per
            # producer, spec and axis), so each pays its share
            param = ins[i].name in traced_params
            nbytes = (c.grad_bytes(ins[i]) if param else tensor_bytes(ins[i])) / shard_factor(st.inputs[i], c.mesh_shape)
            sync = (c.grad_sync(nbytes, a) if param else c.comm("all_reduce", nbytes, a)) / max(1, len(ins[i].users))
            compute[s] += sync
            if param and c.zero < 2:            # ZeRO-2 and -3 reduce-scatter in every microbatch
                once[s] += sync
        compute[s] += _local_impl_time(node, st, c, again=recomputed) if cp is None else 0.0   # cp's are in its time
        # a recomputed node keeps nothing (its region's inputs are charged to their producers): neither
        # what ``saved`` holds for it nor the gather form's gathered K/V
        memory[s] = local_saved(node, st, saved, c) + cp_saved_bytes(node, st, c, recomputed)
    return compute, memory, once


def saved_pair(saved: dict, name: str) -> tuple[int, int]:
    """(graph storages charged to ``name``, tensors it saves itself) from ``saved_bytes_by_node``
    (a plain ``saved_activations`` dict reads as graph storages only)."""
    v = saved.get(name, 0)
    return v if isinstance(v, tuple) else (v, 0)


def cost_key(node: fx.Node, strategies: list[Strategy], saved: dict, traced_params: set[str],
             need: frozenset, recomputed: bool = False) -> tuple:
    """Everything ``node_costs`` reads: two nodes with equal keys cost the same under every strategy
    (the op and its argument signature, which inputs are parameters, need gradients and how many
    consumers share them, how many gradient-needing ops read the node itself (its backward sums their
    gradients: ``compute.grad_sum_work``), the saved-activation bytes, the strategies)."""
    if node.op == "placeholder":
        v = node.meta.get("val")
        shape = (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None
        return ("placeholder", node.name in traced_params, shape, tuple(strategies))
    ins = tuple((a.name in traced_params, a in need, len(a.users)) for a in tensor_inputs(node))
    readers = sum(1 for u in node.users if u.op == "call_function" and u in need)
    return (node.op, node.target, node_signature(node), node in need, ins, readers, saved_pair(saved, node.name),
            tuple(strategies), recomputed)


def local_saved(node: fx.Node, st: Strategy, saved: dict, c: Costing) -> float:
    """Bytes ``node`` saves for backward on one device under strategy ``st`` (``node_costs``'s rule)."""
    act, internal = saved_pair(saved, node.name)
    out_shard = max(1, shard_factor(strategy_outputs(st)[0], c.mesh_shape))
    in_shard = shard_factor(st.inputs[0], c.mesh_shape) if st.inputs else 1
    return act / out_shard + internal / max(out_shard, in_shard)


def edge_cost(src: fx.Node, idx, dst: fx.Node, i: int, cands: Candidates, index, c: Costing) -> EdgeCost:
    d_strats = cands.strategies[dst.name]
    nbytes = tensor_bytes(src, idx)
    s_specs = spec_row(c, cands, src.name, "out", idx)
    d_specs = spec_row(c, cands, dst.name, "in", i)
    frozen = src.name in c.frozen_buffers
    grad = src in grad_nodes(src.graph)
    arg = tensor_inputs(dst)[i]
    fuse = grad and not is_parameter(src) and arg in grad_nodes(dst.graph)    # Megatron-SP: a gather fused with f
    fused_key = ("fused row", dst.name, i, fuse)
    kept = c._tables.get(fused_key)
    if kept is None or kept[0] is not d_strats:
        kept = c._tables[fused_key] = (d_strats, SpecRow(
            (sp, frozenset(a for j, a in grad_sync_inputs(st) if j == i) if fuse else frozenset())
            for sp, st in zip(d_specs, d_strats)))
    d_specs = kept[1]
    users = len(arg.users)
    key = (s_specs, d_specs, nbytes, frozen, grad, users)
    if key not in c._tables:
        us, ud = list(dict.fromkeys(s_specs)), list(dict.fromkeys(d_specs))
        table = np.zeros((len(us), len(ud)))
        memo = c._redistribution
        numbered = search_memo.ENABLED     # specs as small integers: one hash per spec, not per pair
        if numbered:
            ids = c._tables.setdefault("spec ids", {})
            by_id = c._tables.setdefault("redistribution by spec ids", {})
            si = [ids.setdefault(ss, len(ids)) for ss in us]
            di = [ids.setdefault(ds, len(ids)) for ds, _ in ud]
        for a, ss in enumerate(us):
            for b, (ds, f_axes) in enumerate(ud):
                if frozen and ss != ds:
                    table[a, b] = HUGE_COST
                    continue
                if numbered:                                 # the same value ``redistribution_time`` memoises
                    t = by_id.get((si[a], di[b], nbytes, grad))
                    if t is None:
                        t = by_id[(si[a], di[b], nbytes, grad)] = _redistribution_by_ids(si[a], di[b], ss, ds,
                                                                                          nbytes, c, grad)
                else:
                    t = memo.get((ss, ds, nbytes, grad))        # ``redistribution_time``, inlined: every pair
                    if t is None:
                        t = redistribution_time(ss, ds, nbytes, c, grad)
                if f_axes and numbered:
                    saving = by_id.get((si[a], di[b], nbytes, f_axes, users))
                    if saving is None:
                        saving = by_id[(si[a], di[b], nbytes, f_axes, users)] = fused_gather_saving(
                            ss, ds, f_axes, nbytes, users, c)
                    table[a, b] = t - saving
                    continue
                table[a, b] = t - fused_gather_saving(ss, ds, f_axes, nbytes, users, c) if f_axes else t
        pos_s, pos_d = {s: k for k, s in enumerate(us)}, {s: k for k, s in enumerate(ud)}
        ri = np.array([pos_s[s] for s in s_specs])
        ci = np.array([pos_d[s] for s in d_specs])
        c._tables[key] = table[np.ix_(ri, ci)]
    return EdgeCost(index[src.name], index[dst.name], c._tables[key])


def gathered_matrix(param: fx.Node, stored: list[Strategy], users: list[Strategy], i: int, c: Costing) -> np.ndarray:
    """[stored choice, user choice] -> bytes of the copy a user saves when it takes ``param`` in
    another placement than the stored one (``resharded_param_bytes`` per edge)."""
    nbytes = tensor_bytes(param)
    held = tuple(sp.output for sp in stored)
    taken = tuple(st.inputs[i] if i < len(st.inputs) else None for st in users)
    key = ("gathered", held, taken, nbytes)
    if key not in c._tables:
        out = np.zeros((len(stored), len(users)))
        for j, spec in enumerate(taken):
            if spec is None:
                continue
            for k, sp in enumerate(held):
                if spec != sp:
                    out[k, j] = nbytes / shard_factor(spec, c.mesh_shape)
        c._tables[key] = out
    return c._tables[key]
