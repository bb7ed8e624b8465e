"""Lower bounds on memory computed without a solve: of any strategy assignment of an intra-op problem
(the budgeted solve refuses a budget under it at once, ``intra_op._solve_budgeted``), and of the
training state a pipeline rank holds (``state_floor``: a candidate under it is not solved)."""
from __future__ import annotations

import numpy as np

from autopar.cost_models.memory import training_state_bytes
from autopar.sharding.candidates import placeholder_strategies
from autopar.sharding.placements import shard_factor
from autopar.solver.class_graph import is_forbidden


def memory_floor(p) -> float:
    """A lower bound on any assignment's memory (``p``: an ``intra_op.IntraOpProblem``): each
    node's least over its allowed, unforbidden strategies plus each edge's least over its
    unforbidden pairs (the coupling ignored). Above
    the budget, no assignment fits, and the time solves are skipped (Llama-7B on (4, 4) and
    (8, 2) at batch 256: 360.7 GiB of 80, 5.4 s each before)."""
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


def state_floor(traced, mesh_shape: tuple, optimizer: str, precision: str) -> float:
    """A lower bound on the training state (weights, gradients, optimizer state: ``training_state_bytes``,
    as ``unit_costs`` counts a unit's) of the whole model over one ``mesh_shape`` sub-mesh without
    ZeRO: each parameter some op uses, split as finely as any of its placements on that mesh allows
    (``placeholder_strategies``: even shards only; the dims the mesh sizes do not divide stay whole).
    A pipeline of pp stages sums its stages' units, each parameter at least once, so its fullest rank
    holds at least ``state_floor / pp``, whatever the cut, schedule, microbatches or recomputation.
    (Table 1's 1T row on tp 8: pp <= 24 needs more than 80 GiB per rank for the state alone; each
    such candidate took 3-10 s to solve and refuse.)"""
    finest: dict[tuple, int] = {}
    total = 0.0
    for node in traced.gm.graph.nodes:
        if node.op != "placeholder" or node.name not in traced.params or not node.users:
            continue
        v = node.meta["val"]
        key = (tuple(v.shape), node.meta.get("chunk_hint", 1))
        if key not in finest:
            finest[key] = max(shard_factor(st.output, mesh_shape) for st in placeholder_strategies(node, mesh_shape))
        total += training_state_bytes(v.numel(), v.dtype, optimizer, precision) / finest[key]
    return total
