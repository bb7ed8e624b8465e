"""Build the intra-op problem (``intra_op.IntraOpProblem``, what the CP-SAT and elimination solvers
consume) from a traced graph: one node per solved value with its candidates' prices, one edge per
producer -> consumer use with its resharding table (plus, per edge, the share of a gathered copy an
activation's consumer saves: Megatron-SP, ``seq_parallel.with_gathered_copies``), ties of repeated layers, the memory budget and a
feasible hint (``greedy.feasible_hint``). The prices and their formulas are ``strategy_prices.py``'s.

Repeated layers are priced once: nodes with equal ``cost_key`` share their arrays, edges between
alike nodes share their tables (``Costing._memo``). Under recomputation, a region input taken in
another placement than its producer's is kept by the checkpoint: its copy is charged on the edge
(``region_input_uses``). ``resharded_param_bytes`` and ``resharded_region_inputs`` count the same
copies once per (value, placement) for a solved assignment.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx as fx

from autopar.core import search_memo
from autopar.cost_models.memory import saved_bytes_by_node, saves_input
from autopar.cost_models.recompute import saved_bytes_after
from autopar.graph.grads import grad_nodes, is_parameter
from autopar.graph.recompute_regions import choices_for, find_regions
from autopar.sharding.candidates import Candidates, producer
from autopar.sharding.placements import shard_factor
from autopar.sharding.strategy import tensor_inputs
from autopar.solver.axis_descent import axis_keys
from autopar.solver.greedy import feasible_hint
from autopar.solver.intra_op import EdgeCost, IntraOpProblem, NodeChoices, is_forbidden
from autopar.solver.recompute_collectives import region_of, with_recomputed_redistributions
from autopar.solver.seq_parallel import with_gathered_copies
from autopar.solver.strategy_prices import (Costing, cost_key, edge_cost, gathered_matrix, node_costs, saved_pair,
                                            tensor_bytes)


@dataclass
class BuiltProblem:
    """``problem``: one microbatch's costs (the plan's node times); ``once[v]``: the part of node
    v's seconds that runs once per step (``node_costs``)."""
    problem: IntraOpProblem
    names: list[str]
    index: dict[str, int]
    once: list[np.ndarray] = field(default_factory=list)

    def per_step(self, microbatches: int) -> IntraOpProblem:
        """The problem whose objective is the step time over ``microbatches`` microbatches run one
        after another, divided by their number: c[v,s] - (1 - 1/k) once[v,s]. Minimising it
        minimises T(k) = k · every + once (``accumulation.py``); for k = 1 it is ``problem``."""
        if microbatches == 1:
            return self.problem
        f = 1.0 - 1.0 / microbatches
        nodes = [dataclasses.replace(n, compute=np.where(is_forbidden(n.compute), n.compute, n.compute - f * o))
                 if o.any() else n for n, o in zip(self.problem.nodes, self.once)]
        return dataclasses.replace(self.problem, nodes=nodes)

    def once_time(self, choice: list[int]) -> float:
        """Seconds of an assignment's step that run once per step."""
        return float(sum(o[s] for o, s in zip(self.once, choice)))


def activation_weighted(p: IntraOpProblem, names: list[str], params: set[str], weight: float) -> IntraOpProblem:
    """``p`` with what each microbatch in flight holds (non-parameter nodes' saved activations, the
    edges' kept copies) counted ``weight`` times and the parameters' state once: a pipeline's
    whole-model layout then weighs activations as a stage holding several microbatches does
    (``pipeline_search.plan_pipeline``)."""
    if weight == 1.0:
        return p
    nodes = [n if name in params else dataclasses.replace(n, memory=np.asarray(n.memory, dtype=float) * weight)
             for n, name in zip(p.nodes, names)]
    edges = [e if e.memory is None else dataclasses.replace(e, memory=np.asarray(e.memory, dtype=float) * weight)
             for e in p.edges]
    return dataclasses.replace(p, nodes=nodes, edges=edges)


def build_problem(gm: fx.GraphModule, cands: Candidates, c: Costing, params: set[str],
                  allowed: dict[str, list[int]] | None = None, ties: list[list[str]] = (),
                  memory_budget: float | None = None, time_limit_s: float = 10.0) -> BuiltProblem:
    """``params``: placeholder names of parameters (their memory counts training state)."""
    allowed = allowed or {}
    mask = 1 if getattr(c.device, "name", "") != "cpu" else None
    if c.recompute == "none":
        saved, again = saved_bytes_once(gm, mask), frozenset()
    else:
        saved, again = saved_bytes_after(gm, c.recompute, dropout_mask_bytes=mask)
    names = list(cands.strategies)
    index = {n: i for i, n in enumerate(names)}
    by_name = {n.name: n for n in gm.graph.nodes}
    need = grad_nodes(gm.graph)
    kinds = c._memo.get(("kinds", id(cands)))
    if kinds is None:               # repeated layers: one structural key per distinct op, shapes and strategies
        kinds = c._memo[("kinds", id(cands))] = _node_kinds(by_name, cands, params, need)
    nodes, once = [], []
    for n in names:
        key = ("node", kinds[n], saved_pair(saved, n), n in again, c.optimizer, c.precision, c.zero,
               c.grad_element_bytes)
        if key not in c._memo:     # shared by every solve of this graph on this mesh and device
            c._memo[key] = node_costs(by_name[n], cands.strategies[n], c, saved, params, n in again)
        comp, mem, per_step = c._memo[key]
        nodes.append(NodeChoices(n, comp.copy(), mem.copy(), allowed.get(n)))
        once.append(per_step)
    if ("edges", id(cands)) not in c._memo:
        c._memo[("edges", id(cands))] = _edges_of(by_name, names, index, cands, c, params, need, mask)
    edges = list(c._memo[("edges", id(cands))])
    inside = set()
    if c.recompute not in (None, "none"):
        edges = _with_region_input_copies(edges, gm, by_name, names, index, cands, c)
        region = region_of(gm, c.recompute)
        inside = set(region)
        edges = with_recomputed_redistributions(edges, list(graph_edges(names, by_name, index)), cands, c, region)
    edges = with_gathered_copies(edges, list(graph_edges(names, by_name, index)), cands, c, params, need, mask, inside)
    ties_idx = [[index[t] for t in g if t in index] for g in ties]
    ties_idx = [g for g in ties_idx if len(g) > 1 and len({len(cands.strategies[names[i]]) for i in g}) == 1]
    prob = IntraOpProblem(nodes, edges, memory_budget, ties_idx, time_limit_s)
    prob.hint = feasible_hint(prob)
    if ("axis_keys", id(cands)) not in c._memo:
        c._memo[("axis_keys", id(cands))] = axis_keys([cands.strategies[n] for n in names])
    prob.axis_keys = c._memo[("axis_keys", id(cands))]
    return BuiltProblem(prob, names, index, once)


def saved_bytes_once(gm: fx.GraphModule, mask) -> dict[str, tuple[int, int]]:
    """``saved_bytes_by_node(gm, mask)``, once per graph (kept in ``gm.meta`` like
    ``memory_terms.op_gradient_facts``: it depends on the graph only, and the search solves one graph on
    several meshes); read-only."""
    if not search_memo.ENABLED:
        return saved_bytes_by_node(gm, dropout_mask_bytes=mask)
    cache = gm.meta.setdefault("saved_bytes_by_node", {})
    key = (id(gm.graph), len(gm.graph.nodes), mask)
    if key not in cache:
        cache[key] = saved_bytes_by_node(gm, dropout_mask_bytes=mask)
    return cache[key]


def _node_kinds(by_name: dict, cands: Candidates, params: set[str], need: frozenset) -> dict[str, int]:
    """node name -> an integer naming its ``cost_key`` without the costing's inputs (saved
    bytes, recomputation): equal integers cost the same under every strategy. A node's strategy
    list enters the key as the number of its value among the lists seen (``_strategy_rows``): the
    same classes as the key with the list itself, without hashing every strategy of every node."""
    ids: dict = {}
    if not search_memo.ENABLED:
        return {n: ids.setdefault(cost_key(by_name[n], st, {}, params, need), len(ids))
                for n, st in cands.strategies.items()}
    rows = _strategy_rows(cands)
    base = _graph_kinds(by_name, cands, params, need)
    return {n: ids.setdefault((base[n], rows[n]), len(ids)) for n in cands.strategies}


def _graph_kinds(by_name: dict, cands: Candidates, params: set[str], need: frozenset) -> dict[str, int]:
    """node name -> the number of its ``cost_key`` without strategies and costing (equal keys, equal
    numbers), once per graph (kept in the graph module's ``meta``; every mesh the search solves the
    graph on asks for the same keys). Numbers stand for the keys one to one, so ``_node_kinds``' classes
    and their numbering are those of the keys themselves."""
    node = next(iter(by_name.values()))
    gm_meta = node.graph.owning_module.meta if node.graph.owning_module is not None else {}
    cache = gm_meta.setdefault("graph_kinds", {})
    key = (id(node.graph), len(node.graph.nodes), frozenset(params))
    kept = cache.get(key)
    if kept is None or not all(n in kept for n in cands.strategies):
        ids: dict = {}
        kept = cache[key] = {n: ids.setdefault(cost_key(by_name[n], (), {}, params, need), len(ids))
                             for n in cands.strategies}
    return kept


def _strategy_rows(cands: Candidates) -> dict[str, int]:
    """node name -> the number of its strategy list's value (equal lists, equal numbers). Repeated
    layers' lists hold the same Strategy objects (``mesh_strategies`` is memoised), so a list is
    looked up by its members' identities first and hashed by value once per distinct identity row
    (every member is alive in ``cands`` while this runs, so identities are not reused)."""
    by_value: dict = {}
    by_identity: dict = {}
    out = {}
    for n, strategies in cands.strategies.items():
        ident = tuple(map(id, strategies))
        row = by_identity.get(ident)
        if row is None:
            row = by_identity[ident] = by_value.setdefault(tuple(strategies), len(by_value))
        out[n] = row
    return out


def _edges_of(by_name: dict, names: list[str], index: dict, cands: Candidates, c: Costing, params: set[str],
              need: frozenset, mask) -> list[EdgeCost]:
    """Every producer -> consumer edge with its resharding table and, where the consumer keeps a
    parameter in another placement, the gathered copy's bytes (``gathered_matrix``, the edge's
    ``memory``). They depend on the graph, the candidates, the mesh and the device only."""
    kinds = c._memo.get(("kinds", id(cands))) or {}
    alike: dict = {}        # repeated layers' edges: (kinds, positions, bytes) -> (table, kept bytes)
    edges = []
    for n, node, i, a, src, idx in graph_edges(names, by_name, index):
        keeps = src.name in params and node in need and saves_input(node, a, mask)
        key = (kinds.get(src.name), idx, kinds.get(n), i, tensor_bytes(src, idx), src.name in c.frozen_buffers,
               src in need, keeps) if src.name in kinds and n in kinds else None
        if key is None or key not in alike:
            edge = edge_cost(src, idx, node, i, cands, index, c)
            kept = gathered_matrix(a, cands.strategies[src.name], cands.strategies[n], i, c) if keeps else None
            table = (edge.cost, kept if kept is not None and kept.any() else None)
            if key is None:
                edges.append(EdgeCost(edge.src, edge.dst, *table))
                continue
            alike[key] = table
        edges.append(EdgeCost(index[src.name], index[n], *alike[key]))
    return edges


def graph_edges(names: list[str], by_name: dict, index: dict):
    """(consumer name, consumer, input position, input, producer, output index) of every edge between
    solved nodes, in one fixed order (the problem's edge list is built in it)."""
    for n in names:
        node = by_name[n]
        if node.op != "call_function":
            continue
        for i, a in enumerate(tensor_inputs(node)):
            src, idx = producer(a)
            if src.name in index:
                yield n, node, i, a, src, idx


def resharded_param_bytes(gm: fx.GraphModule, cands: Candidates, built: BuiltProblem, choice: list[int],
                          c: Costing, params: set[str]) -> float:
    """Bytes of parameters that ops use in another placement than the stored one and keep for
    backward: the gathered copy (a tied lm-head weight all-gathered for a batch-split matmul) is
    an activation the node memory cannot see (it depends on the parameter's choice and the
    consumer's, an edge). One copy per (parameter, placement): the pass emits one per spec. The
    budget constraint charges the copies per edge (the problem's edge memory G, at least this)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    mask = 1 if getattr(c.device, "name", "") != "cpu" else None
    need = grad_nodes(gm.graph)
    seen, total = set(), 0.0
    for name in built.names:
        node = by_name[name]
        if node.op != "call_function" or node not in need:
            continue
        st = cands.strategies[name][choice[built.index[name]]]
        for i, a in enumerate(tensor_inputs(node)):
            if a.name not in params or a.name not in built.index or i >= len(st.inputs):
                continue
            stored = cands.strategies[a.name][choice[built.index[a.name]]].output
            spec = st.inputs[i]
            if spec == stored or (a.name, spec) in seen or not saves_input(node, a, mask):
                continue
            seen.add((a.name, spec))
            total += tensor_bytes(a) / shard_factor(spec, c.mesh_shape)
    return total


def region_input_uses(gm: fx.GraphModule, c: Costing) -> set[tuple[str, int]]:
    """(consumer, input position) of each use of a region's input inside a recomputed region: the
    checkpoint keeps the input as the consumer takes it (after any redistribution), so a consumer
    that takes it in another placement than its producer's keeps a copy for backward."""
    uses = set()
    for r in find_regions(gm, choices_for(gm.graph, c.recompute)):
        inside = set(r.nodes)
        for v in gm.graph.nodes:
            if v.name not in inside or v.op != "call_function":
                continue
            for i, a in enumerate(tensor_inputs(v)):
                if producer(a)[0].name not in inside and isinstance(a.meta.get("val"), torch.Tensor) \
                        and not is_parameter(producer(a)[0]):
                    uses.add((v.name, i))
    return uses


def _with_region_input_copies(edges: list[EdgeCost], gm: fx.GraphModule, by_name: dict, names: list[str],
                              index: dict, cands: Candidates, c: Costing) -> list[EdgeCost]:
    """``edges`` (in ``_edges_of``'s order) with the memory of a region input's redistributed copy
    (``region_input_uses``): bytes under the consumer's input placement where it differs from the
    producer's output placement, per edge (two consumers of one copy are both charged)."""
    uses = region_input_uses(gm, c)
    out = list(edges)
    for pos, (n, _, i, _, src, idx) in enumerate(graph_edges(names, by_name, index)):
        if (n, i) not in uses:
            continue
        e = out[pos]
        nbytes = tensor_bytes(src, idx)
        s_specs = [st.output if idx is None else st.output[idx] for st in cands.strategies[src.name]]
        kept = np.zeros((len(s_specs), len(cands.strategies[n])))
        for j, st in enumerate(cands.strategies[n]):
            if i < len(st.inputs):
                kept[:, j] = [0.0 if sp == st.inputs[i] else nbytes / shard_factor(st.inputs[i], c.mesh_shape)
                              for sp in s_specs]
        if kept.any():
            out[pos] = dataclasses.replace(e, memory=kept if e.memory is None else e.memory + kept)
    return out


def resharded_region_inputs(gm: fx.GraphModule, cands: Candidates, built: BuiltProblem, choice: list[int],
                            c: Costing) -> float:
    """Bytes of the redistributed copies of recomputed regions' inputs under an assignment, one per
    (input, placement) (what the lowering keeps; the ILP charges them per edge)."""
    if c.recompute in (None, "none"):
        return 0.0
    by_name = {n.name: n for n in gm.graph.nodes}
    seen, total = set(), 0.0
    for name, i in region_input_uses(gm, c):
        if name not in built.index:
            continue
        a = tensor_inputs(by_name[name])[i]
        src, idx = producer(a)
        if src.name not in built.index:
            continue
        st = cands.strategies[name][choice[built.index[name]]]
        out = cands.strategies[src.name][choice[built.index[src.name]]].output
        have = out if idx is None else out[idx]
        if i >= len(st.inputs) or st.inputs[i] == have or (src.name, idx, st.inputs[i]) in seen:
            continue
        seen.add((src.name, idx, st.inputs[i]))
        total += tensor_bytes(src, idx) / shard_factor(st.inputs[i], c.mesh_shape)
    return total
