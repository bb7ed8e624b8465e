"""Build the intra-op problem from a traced graph: costs of every candidate strategy.

node cost c[v,s]   = (compute(v) - launches) / work_split(s) + launches   (``split_cost``;
                       matmuls costed on their local shapes)
                     + backward all-reduce of each Replicate input that s uses split
                       (Megatron's ``f``; for parameters this is the gradient sync)
                     + the small collectives of s's local implementation (vocab-parallel
                       loss, synced batch-norm statistics)
node memory m[v,s] = parameters: numel · training-state bytes/param / shard factor
                     activations saved for backward / shard factor of the output
edge cost R[u,v]   = redistribution of u's output spec into v's required input spec,
                     forward collectives plus their conjugates in backward  (``_edge_cost``)

Gradient sync of a parameter is bucketed at run time (DDP buckets of ``GRAD_BUCKET_BYTES``, the
pipeline's one flat buffer), so one parameter of n bytes pays the bandwidth term in full and
``n / GRAD_BUCKET_BYTES`` of one all-reduce's latency (``Costing.grad_sync``); the latency of
the step's last, partly filled bucket is added once per step (``grad_sync_overhead``).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx as fx

from autopar.cost_models.comm import axis_collective_time
from autopar.cost_models.compute import (OpCost, grad_nodes, local_node_cost, node_cost, optimizer_step_time,
                                         work_signature)
from autopar.cost_models.memory import saved_activations, training_state_bytes_per_param
from autopar.sharding.candidates import Candidates, producer
from autopar.sharding.local_impls import local_collectives
from autopar.sharding.placements import Partial, Replicate, Shard, local_shape, shard_factor
from autopar.sharding.redistribute import backward_kind, redistribute_steps, step_bytes
from autopar.sharding.strategy import Strategy, tensor_inputs
from autopar.solver.intra_op import HUGE_COST, EdgeCost, IntraOpProblem, NodeChoices

GRAD_BUCKET_BYTES = 25 * 2**20     # DDP's bucket_cap_mb default, used by runtime.grad_sync


@dataclass
class Costing:
    """What the cost functions need to know about the mesh and the training setup."""

    mesh_shape: tuple
    device: object                  # DeviceSpec
    optimizer: str = "adamw"
    precision: str = "fp32"
    frozen_buffers: set = field(default_factory=set)   # placeholders that must never be redistributed
    _redistribution: dict = field(default_factory=dict, repr=False)  # (src, dst, bytes) -> seconds
    _edges: dict = field(default_factory=dict, repr=False)           # edge tables of repeated layers

    def inner(self, axis: int) -> int:
        return math.prod(self.mesh_shape[axis + 1:])

    def comm(self, kind: str, nbytes: float, axis: int) -> float:
        if kind in ("local_slice", "to_partial") or nbytes <= 0:
            return 0.0
        return axis_collective_time(kind, nbytes, self.device, self.mesh_shape[axis], self.inner(axis))

    def latency(self, axis: int) -> float:
        """The size-independent part of an all-reduce over ``axis``."""
        return self.comm("all_reduce", 1.0, axis)

    def grad_sync(self, nbytes: float, axis: int) -> float:
        """One parameter's share of the bucketed gradient all-reduce over ``axis`` (module docstring)."""
        if nbytes <= 0:
            return 0.0
        lat = self.latency(axis)
        return self.comm("all_reduce", nbytes, axis) - lat + lat * min(1.0, nbytes / GRAD_BUCKET_BYTES)


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
    for st in redistribute_steps(src, dst):
        moved, local_after = step_bytes(st, local, c.mesh_shape)
        total += c.comm(st.kind, moved, st.axis)
        bwd = backward_kind(st.kind) if grad else None
        if bwd:
            total += c.comm(bwd, moved, st.axis)
        local = local_after
    return total


def _outs(st: Strategy) -> list:
    o = st.output
    return list(o) if o and isinstance(o[0], tuple) else [o]


def work_split(st: Strategy, mesh_shape) -> int:
    specs = list(st.inputs) + _outs(st)
    return max([shard_factor(s, mesh_shape) for s in specs] + [1])


def split_cost(node: fx.Node, base: OpCost, st: Strategy, ins: list[fx.Node], c: Costing) -> OpCost:
    """One rank's cost of ``node`` under ``st``: the work divided by :func:`work_split`, kernel
    launches not divided (``OpCost.scaled``); a matmul is costed on its local shapes instead,
    since its efficiency follows its smallest local dimension."""
    f = work_split(st, c.mesh_shape)
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
    for o in _outs(st):
        for a, p in enumerate(o):
            if not isinstance(p, Replicate):
                axes.add(a)
    return axes


def grad_sync_inputs(st: Strategy) -> list[tuple[int, int]]:
    """(input index, axis) pairs whose gradient needs an all-reduce over the axis."""
    axes = split_axes(st)
    return [(i, a) for i, spec in enumerate(st.inputs) for a in axes if isinstance(spec[a], Replicate)]


def _local_impl_time(node: fx.Node, st: Strategy, c: Costing) -> float:
    """The collectives of ``st``'s local implementation (``sharding/local_impls.py``), forward
    and backward: the same list the plan shows."""
    return sum(c.comm(kind, nbytes, ax) for kind, nbytes, ax, _ in local_collectives(node, st, c.mesh_shape))


def node_costs(node: fx.Node, strategies: list[Strategy], c: Costing, saved: dict[str, int],
               traced_params: set[str]) -> tuple[np.ndarray, np.ndarray]:
    k = len(strategies)
    compute, memory = np.zeros(k), np.zeros(k)
    if node.op == "placeholder":
        if node.name in traced_params:
            v = node.meta["val"]
            state = v.numel() * training_state_bytes_per_param(c.optimizer, c.precision)
            for s, st in enumerate(strategies):
                shards = shard_factor(st.output, c.mesh_shape)
                memory[s] = state / shards
                compute[s] = optimizer_step_time(v.numel() / shards, c.device, 1, c.optimizer)
        return compute, memory
    base = node_cost(node, c.device)
    need = grad_nodes(node.graph)
    ins = tensor_inputs(node)
    act = saved.get(node.name, 0)
    for s, st in enumerate(strategies):
        compute[s] = split_cost(node, base, st, ins, c).time_total
        for i, a in grad_sync_inputs(st):
            if ins[i] not in need:
                continue
            # consumers needing the same gradient all-reduce share one (the pass emits one per
            # producer, spec and axis), so each pays its share
            nbytes = tensor_bytes(ins[i]) / shard_factor(st.inputs[i], c.mesh_shape)
            sync = c.grad_sync(nbytes, a) if ins[i].name in traced_params else c.comm("all_reduce", nbytes, a)
            compute[s] += sync / max(1, len(ins[i].users))
        compute[s] += _local_impl_time(node, st, c)
        outs = _outs(st)
        memory[s] = act / max(1, shard_factor(outs[0], c.mesh_shape))
    return compute, memory


def cost_key(node: fx.Node, strategies: list[Strategy], saved: dict[str, int], traced_params: set[str],
             need: frozenset) -> tuple:
    """Everything ``node_costs`` reads: two nodes with equal keys cost the same under every strategy
    (the op and its argument signature, which inputs are parameters, need gradients and how many
    consumers share them, the saved-activation bytes, the strategies)."""
    if node.op == "placeholder":
        v = node.meta.get("val")
        shape = (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None
        return ("placeholder", node.name in traced_params, shape, tuple(strategies))
    ins = tuple((a.name in traced_params, a in need, len(a.users)) for a in tensor_inputs(node))
    return (node.op, node.target, work_signature(node, need), node in need, ins, saved.get(node.name, 0),
            tuple(strategies))


@dataclass
class BuiltProblem:
    problem: IntraOpProblem
    names: list[str]
    index: dict[str, int]


def build_problem(gm: fx.GraphModule, cands: Candidates, c: Costing, params: set[str],
                  allowed: dict[str, list[int]] | None = None, ties: list[list[str]] = (),
                  memory_budget: float | None = None, time_limit_s: float = 10.0) -> BuiltProblem:
    """``params``: placeholder names of parameters (their memory counts training state)."""
    allowed = allowed or {}
    saved = saved_activations(gm, dropout_mask_bytes=1 if getattr(c.device, "name", "") != "cpu" else None)
    names = list(cands.strategies)
    index = {n: i for i, n in enumerate(names)}
    by_name = {n.name: n for n in gm.graph.nodes}
    need = grad_nodes(gm.graph)
    nodes, memo = [], {}
    for n in names:
        key = cost_key(by_name[n], cands.strategies[n], saved, params, need)
        if key not in memo:         # repeated layers: one costing per distinct op, shapes and strategies
            memo[key] = node_costs(by_name[n], cands.strategies[n], c, saved, params)
        comp, mem = memo[key]
        nodes.append(NodeChoices(n, comp.copy(), mem.copy(), allowed.get(n)))
    edges = []
    for n in names:
        node = by_name[n]
        if node.op != "call_function":
            continue
        for i, a in enumerate(tensor_inputs(node)):
            src, idx = producer(a)
            if src.name not in index:
                continue
            edges.append(_edge(src, idx, node, i, cands, index, c))
    ties_idx = [[index[t] for t in g if t in index] for g in ties]
    ties_idx = [g for g in ties_idx if len(g) > 1 and len({len(cands.strategies[names[i]]) for i in g}) == 1]
    prob = IntraOpProblem(nodes, edges, memory_budget, ties_idx, time_limit_s)
    prob.hint = feasible_hint(prob)
    return BuiltProblem(prob, names, index)


def feasible_hint(p: IntraOpProblem) -> list[int]:
    """Greedy assignment that fits the budget: memory priced at λ s/byte (a Lagrangian
    relaxation of the memory constraint), λ raised tenfold until the greedy choice fits."""
    choice = greedy_choice(p, 0.0)
    if p.memory_budget is None:
        return choice
    price = 1e-15
    while sum(float(n.memory[s]) for n, s in zip(p.nodes, choice)) > p.memory_budget and price < 1e3:
        choice = greedy_choice(p, price)
        price *= 10
    return choice


def greedy_choice(p: IntraOpProblem, memory_price: float = 0.0) -> list[int]:
    """Graph order, each node its cheapest allowed strategy given its producers' choices
    (cost = time + memory_price · bytes); tied nodes follow the first of their group."""
    incoming: dict[int, list[EdgeCost]] = {}
    for e in p.edges:
        incoming.setdefault(e.dst, []).append(e)
    leader = {m: g[0] for g in p.ties for m in g}
    choice: list[int] = []
    for v, node in enumerate(p.nodes):
        if v in leader and leader[v] != v:
            choice.append(choice[leader[v]])
            continue
        cost = np.array(node.compute, dtype=float) + memory_price * np.asarray(node.memory, dtype=float)
        for e in incoming.get(v, []):
            if e.src < v:
                cost = cost + e.cost[choice[e.src], :]
        allowed = node.allowed if node.allowed is not None else range(len(cost))
        choice.append(min(allowed, key=lambda s: cost[s]))
    return choice


def _edge(src: fx.Node, idx, dst: fx.Node, i: int, cands: Candidates, index, c: Costing) -> EdgeCost:
    s_strats, d_strats = cands.strategies[src.name], cands.strategies[dst.name]
    nbytes = tensor_bytes(src, idx)
    s_specs = tuple(st.output if idx is None else st.output[idx] for st in s_strats)
    d_specs = tuple(st.inputs[i] for st in d_strats)
    frozen = src.name in c.frozen_buffers
    grad = src in grad_nodes(src.graph)
    key = (s_specs, d_specs, nbytes, frozen, grad)
    if key not in c._edges:
        us, ud = list(dict.fromkeys(s_specs)), list(dict.fromkeys(d_specs))
        table = np.zeros((len(us), len(ud)))
        for a, ss in enumerate(us):
            for b, ds in enumerate(ud):
                table[a, b] = HUGE_COST if frozen and ss != ds else redistribution_time(ss, ds, nbytes, c, grad)
        pos_s, pos_d = {s: k for k, s in enumerate(us)}, {s: k for k, s in enumerate(ud)}
        ri = np.array([pos_s[s] for s in s_specs])
        ci = np.array([pos_d[s] for s in d_specs])
        c._edges[key] = table[np.ix_(ri, ci)]
    return EdgeCost(index[src.name], index[dst.name], c._edges[key])


__all__ = ["GRAD_BUCKET_BYTES", "grad_sync_overhead", "Costing", "build_problem", "BuiltProblem", "redistribution_time", "grad_sync_inputs", "work_split",
           "Shard", "Partial"]
