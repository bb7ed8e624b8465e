"""What sequence parallelism (Megatron-SP) changes in the intra-op problem's costs and memory.

Megatron-SP is no new strategy: the norms, dropouts and residual adds of a tensor-parallel block
take their ``Shard(seq)`` option on the tp axis (``sharding/rules/norm.py``, ``pointwise.py``), the
row-parallel linear's ``Partial`` output reaches them by a reduce-scatter (``redistribute_steps``:
P -> S) and the column-parallel linear takes its input by an all-gather (S -> R). Two terms make the
ILP price that as it runs:

* **time** (``fused_gather_saving``): a consumer that runs split on an axis where it takes an input
  replicated pays a backward all-reduce of that input's gradient (Megatron's f, ``strategy_prices.node_costs``).
  Where the input arrives by an all-gather on that axis, the lowering fuses the two: the gather's
  backward is a reduce-scatter (``sharding/edge.py``, ``comm.all_gather_rs``). The edge gives back
  the difference, so SP costs reduce-scatter + all-gather forward and all-gather + reduce-scatter
  backward: the bytes of the all-reduces it replaces.
* **memory** (``gathered_copy_bytes``, ``resharded_saved_activations``): node memory charges a saved
  activation at its producer's placement. A consumer that saves an input it takes gathered (the
  column-parallel linear keeps its all-gathered input for the weight gradient) keeps the gathered
  copy, and the producer's smaller piece is freed when no consumer saves it as is. The ILP charges
  each saving consumer's edge its share of the copy beyond the piece; the plan's memory counts the
  copies exactly after the solve (one per value and placement).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch.fx as fx

from autopar.core import search_memo
from autopar.cost_models.memory import saves_input
from autopar.graph.grads import grad_nodes
from autopar.sharding.candidates import producer
from autopar.sharding.edge import fused_gathers
from autopar.sharding.placements import shard_factor
from autopar.sharding.redistribute import cached_steps
from autopar.sharding.strategy import tensor_inputs
from autopar.solver.spec_rows import spec_row


def fused_gather_saving(have, want, f_axes, nbytes: float, users: int, c) -> float:
    """Seconds a consumer's backward all-reduces (over ``f_axes``, of the input as it takes it:
    ``nbytes`` whole) save when the redistribution ``have -> want`` ends in an all-gather on that axis
    (its backward becomes the reduce-scatter that sums the gradient). ``users``: consumers sharing
    the all-reduce (each pays its share, as ``node_costs`` charges it)."""
    if not f_axes or have == want:
        return 0.0
    local = nbytes / shard_factor(want, c.mesh_shape)
    steps = cached_steps(have, want)
    saved = 0.0
    for j in fused_gathers(steps, set(f_axes)):
        a = steps[j].axis
        saved += c.comm("all_reduce", local, a) - c.comm("reduce_scatter", local, a)
    return saved / max(1, users)


def gathered_copy_table(s_specs, d_specs, nbytes: float, savers: int, c) -> np.ndarray | None:
    """[producer choice, consumer choice] -> bytes a consumer that saves its input keeps beyond the
    producer's piece when it takes the input in a placement split fewer ways (a gathered copy),
    shared among the ``savers`` consumers that save it (None: no such pair)."""
    out = np.zeros((len(s_specs), len(d_specs)))
    for k, have in enumerate(s_specs):
        piece = nbytes / shard_factor(have, c.mesh_shape)
        for j, want in enumerate(d_specs):
            if want is not None and want != have:
                out[k, j] = max(0.0, nbytes / shard_factor(want, c.mesh_shape) - piece) / max(1, savers)
    return out if out.any() else None


def saving_consumers(value: fx.Node, mask) -> int:
    """How many of ``value``'s users save it for backward."""
    return sum(1 for u in value.users if saves_input(u, value, mask))


def resharded_saved_activations(gm: fx.GraphModule, cands, built, choice: list[int], c, params: set[str],
                                tensor_bytes, inside: set[str] = frozenset()) -> float:
    """Bytes an assignment keeps in gathered copies of saved activations beyond what node memory
    charges: per (value, placement split fewer ways than the producer's) one copy, less the
    producer's piece where every consumer that saves the value saves a copy (the piece is then
    freed after the forward). ``inside``: nodes of recomputed regions (they save nothing)."""
    mask = 1 if getattr(c.device, "name", "") != "cpu" else None
    need = grad_nodes(gm.graph)
    uses: dict = {}
    by_name = {n.name: n for n in gm.graph.nodes}
    for name in built.names:
        node = by_name[name]
        if node.op != "call_function" or node not in need or name in inside:
            continue
        st = cands.strategies[name][choice[built.index[name]]]
        for i, a in enumerate(tensor_inputs(node)):
            src, idx = producer(a)
            if src.name in params or src.name not in built.index or i >= len(st.inputs) \
                    or not saves_input(node, a, mask):
                continue
            out = cands.strategies[src.name][choice[built.index[src.name]]].output
            have = out if idx is None else out[idx]
            uses.setdefault((src.name, idx), (have, []))[1].append(st.inputs[i])
    total = 0.0
    for (src, idx), (have, wants) in uses.items():
        nbytes = tensor_bytes(by_name[src], idx)
        piece = nbytes / shard_factor(have, c.mesh_shape)
        copies = {w for w in wants if w != have and shard_factor(w, c.mesh_shape) < shard_factor(have, c.mesh_shape)}
        total += sum(nbytes / shard_factor(w, c.mesh_shape) for w in copies)
        if copies and all(w in copies for w in wants):
            total -= piece
    return total


def with_gathered_copies(edges: list, graph_edges, cands, c, params: set[str], need, mask,
                         inside: set[str] = frozenset()) -> list:
    """``edges`` (in ``graph_edges``' order: ``problem.graph_edges``) with ``gathered_copy_table``
    added to the memory of each edge whose consumer saves a non-parameter input (consumers in
    recomputed regions, ``inside``, save nothing)."""
    out = list(edges)
    for pos, n, i, src, idx, nbytes, savers in _saving_edges(graph_edges, params, need, mask, inside):
        s_specs, d_specs = spec_row(c, cands, src, "out", idx), spec_row(c, cands, n, "in", i)
        key = ("gathered copy", s_specs, d_specs, nbytes, savers)
        if key not in c._tables:
            c._tables[key] = gathered_copy_table(s_specs, d_specs, nbytes, key[-1], c)
        kept = c._tables[key]
        if kept is not None:
            e = out[pos]
            out[pos] = dataclasses.replace(e, memory=kept if e.memory is None else e.memory + kept)
    return out


def _saving_edges(graph_edges, params: set[str], need, mask, inside) -> list[tuple]:
    """(position, consumer, input position, producer, output index, bytes, saving consumers) of each edge
    whose consumer saves a non-parameter input (``with_gathered_copies``' filter): a function of the graph,
    the save mask and the recomputed nodes only, kept in the graph module's ``meta`` under ``search_memo``
    (every mesh the search solves one graph on asks for the same list)."""
    graph_edges = list(graph_edges)
    gm = graph_edges[0][1].graph.owning_module if graph_edges else None
    cache = None
    if search_memo.ENABLED and gm is not None and hasattr(gm, "meta"):
        cache = search_memo.graph_cache(gm, "saving_edges")
        key = (len(graph_edges), mask, frozenset(inside), frozenset(params))
        if key in cache:
            return cache[key]
    rows = []
    for pos, (n, node, i, a, src, idx) in enumerate(graph_edges):
        if src.name in params or node not in need or n in inside or not saves_input(node, a, mask):
            continue
        v = src.meta.get("val")
        v = v[idx] if idx is not None and isinstance(v, (tuple, list)) else v
        nbytes = float(v.numel() * v.element_size()) if hasattr(v, "numel") else 0.0
        rows.append((pos, n, i, src.name, idx, nbytes, saving_consumers(a, mask)))
    if cache is not None:
        cache[key] = rows
    return rows
