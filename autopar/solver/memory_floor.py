"""Lower bounds on memory computed without a solve: of any strategy assignment of an intra-op problem
(the budgeted solve refuses a budget under it at once, ``intra_op._solve_budgeted``), and of what a
pipeline's units hold under any layout (``state_floor``, ``unit_floors``: a pipeline candidate
that cannot fit by them is not solved, ``pipeline_fit.fit_refusal``)."""
from __future__ import annotations

import numpy as np

from autopar.cost_models.memory import training_state_bytes
from autopar.cost_models.recompute import saved_storages
from autopar.sharding.candidates import placeholder_strategies
from autopar.sharding.placements import shard_factor
from autopar.sharding.strategy import tensor_inputs
from autopar.core import search_memo
from autopar.solver.class_graph import allowed_mask, is_forbidden


def memory_floor(p) -> float:
    """A lower bound on any assignment's memory (``p``: an ``intra_op.IntraOpProblem``): each
    node's least over its allowed, unforbidden strategies plus each edge's least over its
    unforbidden pairs (the coupling ignored). Above
    the budget, no assignment fits, and the time solves are skipped."""
    if search_memo.ENABLED and p.nodes and all(len(n.compute) for n in p.nodes):
        return _memory_floor_arrays(p)
    total = 0.0
    for n in p.nodes:
        compute = np.asarray(n.compute, dtype=float)
        ok = ~is_forbidden(compute)
        if n.allowed is not None:
            ok &= np.isin(np.arange(len(compute)), list(n.allowed))
        if not ok.any():
            return 0.0              # infeasible for another reason: let the solve say which
        total += float(np.asarray(n.memory, dtype=float)[ok].min())
    for e in p.edges:
        if e.memory is not None:
            ok = ~is_forbidden(np.asarray(e.cost, dtype=float))
            total += float(np.asarray(e.memory, dtype=float)[ok].min()) if ok.any() else 0.0
    return total


def _memory_floor_arrays(p) -> float:
    """``memory_floor`` on the nodes' arrays joined end to end (one numpy pass instead of one per node)
    and each distinct edge table once (repeated layers share them, ``problem._edges_of``): the same
    terms, added in the same order, so the same float."""
    sizes = [len(n.compute) for n in p.nodes]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.intp)
    ok = ~is_forbidden(np.concatenate([np.asarray(n.compute, dtype=float) for n in p.nodes]))
    for n, at, k in zip(p.nodes, starts.tolist(), sizes):
        if n.allowed is not None:
            ok[at:at + k] &= allowed_mask(k, n.allowed)
    if not np.logical_or.reduceat(ok, starts).all():
        return 0.0                  # infeasible for another reason: let the solve say which
    memory = np.concatenate([np.asarray(n.memory, dtype=float) for n in p.nodes])
    total = 0.0
    for least in np.minimum.reduceat(np.where(ok, memory, np.inf), starts).tolist():
        total += least
    seen: dict = {}
    for e in p.edges:
        if e.memory is not None:
            key = (id(e.cost), id(e.memory))
            if key not in seen:
                fine = ~is_forbidden(np.asarray(e.cost, dtype=float))
                seen[key] = float(np.asarray(e.memory, dtype=float)[fine].min()) if fine.any() else 0.0
            total += seen[key]
    return total


def unit_floors(traced, units, mesh_shape: tuple, optimizer: str, precision: str, recompute,
                dropout_mask_bytes) -> tuple[list[float], list[float]]:
    """Per pipeline unit, lower bounds on what ``unit_costs.unit_profiles`` charges it under any
    layout on a ``mesh_shape`` sub-mesh: (training state: each parameter its ops use, split as
    finely as its placements allow; saved activations at the traced batch under ``recompute``,
    each storage once as the profiles count it, split over every device of the sub-mesh). The
    profiles scale activations linearly from the microbatch they are solved at, at most the traced
    batch, so ``activations * b / batch`` bounds them at microbatch b."""
    finest = param_floors(traced, mesh_shape, optimizer, precision)
    size = int(np.prod(mesh_shape))
    by_name = {n.name: n for n in traced.gm.graph.nodes}
    saved: dict[str, list[tuple[object, int]]] = {}
    for node_name, key, nbytes, *_ in saved_storages(traced.gm, recompute or "none", dropout_mask_bytes):
        saved.setdefault(node_name, []).append((key, nbytes))
    seen: set = set()
    state, acts = [], []
    for unit in units:
        params, act = set(), 0.0
        for name in unit.nodes:
            node = by_name[name]
            if node.op != "call_function":
                continue
            for key, nbytes in saved.get(name, []):
                if key not in seen:
                    seen.add(key)
                    act += nbytes / size
            params |= {a.name for a in tensor_inputs(node) if a.name in finest}
        state.append(sum(finest[p] for p in params))
        acts.append(act)
    return state, acts


def param_floors(traced, mesh_shape: tuple, optimizer: str, precision: str) -> dict[str, float]:
    """Each parameter some op uses (by placeholder): its training state (``training_state_bytes``, as
    ``unit_costs`` counts it) over the finest split its placements on the mesh allow
    (``placeholder_strategies``: even shards only; dims the mesh sizes do not divide stay whole)."""
    finest: dict[tuple, int] = {}
    out = {}
    for node in traced.gm.graph.nodes:
        if node.op != "placeholder" or node.name not in traced.params or not node.users:
            continue
        v = node.meta["val"]
        key = (tuple(v.shape), node.meta.get("chunk_hint", 1))
        if key not in finest:
            finest[key] = max(shard_factor(st.output, mesh_shape) for st in placeholder_strategies(node, mesh_shape))
        out[node.name] = training_state_bytes(v.numel(), v.dtype, optimizer, precision) / finest[key]
    return out


def state_floor(traced, mesh_shape: tuple, optimizer: str, precision: str) -> float:
    """A lower bound on the training state of the whole model over one ``mesh_shape`` sub-mesh without
    ZeRO: the sum of ``param_floors``. A pipeline of pp stages sums its stages' units, each
    parameter at least once, so its fullest rank holds at least ``state_floor / pp``, whatever
    the cut, schedule, microbatches or recomputation."""
    return sum(param_floors(traced, mesh_shape, optimizer, precision).values())
