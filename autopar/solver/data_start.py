"""A data-parallel start for the intra-op solve of a mesh with several named data axes.

A named mesh says which axes are data-parallel ("dp", and the expert axes "ep"/"expert", which
are data axes for the dense ops: ``mesh_solve._axis_roles``). Its layout as published (every op
on a rank's part of the batch on every data axis, the experts split on the expert axes) is then
a known good assignment, but on a big problem over several axes neither the greedy hint nor the
block descent from it (``axis_descent``) reliably reaches it: a descent changes one axis at a
time, and an op gathered on one data axis while split by hidden or sequence on another is a
local optimum no single-axis change leaves (a 2-layer DeepSeek-V3 on dp 2 x expert 8 x ep 8: the
"dp" axis kept whole and the hidden dim split on "ep", 0.36 s a step where the batch split
takes 0.30 s). So the solve gets a second start:

    restrict every op whose output carries the batch (``degrees._batch_dims``: dim 0 of the
    inputs, followed through the ops that keep it) to its strategies that split that dim on
    every data axis of size > 1 (where it has any), leave the others (parameters, constants,
    the loss) free, and solve that restricted problem;

``axis_descent.solve_with_start`` descends from it as from the greedy hint and keeps the
better, so the plan is never slower than the data-parallel layout (when that fits).
"""
from __future__ import annotations

import dataclasses

from autopar.core.mesh import Mesh
from autopar.sharding.placements import Shard
from autopar.solver.degrees import _batch_dims
from autopar.solver.greedy import greedy_choice
from autopar.solver.intra_op import InfeasibleError, IntraOpProblem, SolverTimeoutError
from autopar.solver.moe_axes import ROLE_EXPERT

DATA_ROLES = ("dp", "data", "batch") + ROLE_EXPERT     # mesh_solve.ROLE_DATA (which imports this) + the expert axes
SHARE = 0.15            # of the time limit the restricted solve may use


def data_axes(mesh: Mesh) -> list[int]:
    """The named data (and expert) axes of size > 1."""
    if not mesh.named:
        return []
    return [a for a, n in enumerate(mesh.axis_names) if n in DATA_ROLES and mesh.shape[a] > 1]


def _splits_batch(spec, axes: list[int], dim: int, ndim: int) -> bool:
    return all(isinstance(spec[a], Shard) and spec[a].dim % ndim == dim for a in axes)


def batch_split_allowed(traced, cands, mesh: Mesh, allowed: dict) -> dict[str, list[int]] | None:
    """Per node carrying the batch, its allowed strategies that split the batch on every data axis
    (nodes without any keep theirs); None when the mesh has fewer than two such axes (one data axis
    is a single-axis problem the solve handles)."""
    axes = data_axes(mesh)
    if len(axes) < 2:
        return None
    feeds = [*traced.inputs, *([traced.target] if traced.target else [])]
    bdims = _batch_dims(traced.gm, {ph: None for ph in feeds})
    by_name = {n.name: n for n in traced.gm.graph.nodes}
    out: dict[str, list[int]] = {}
    for name, strategies in cands.strategies.items():
        node = by_name.get(name)
        if node is None or node.op != "call_function":
            continue
        val = node.meta.get("val")
        multi = isinstance(val, (tuple, list))
        outs = [(j, v) for j, v in enumerate(val)] if multi else [(None, val)]
        dims = [(k, bdims[(name, j)], v.dim()) for k, (j, v) in enumerate(outs)
                if (name, j) in bdims and hasattr(v, "dim") and v.dim()]
        if not dims:
            continue
        base = allowed.get(name, range(len(strategies)))
        keep = []
        for i in base:
            specs = strategies[i].output if multi else (strategies[i].output,)
            if all(specs[k] is not None and _splits_batch(specs[k], axes, d, nd) for k, d, nd in dims):
                keep.append(i)
        if keep:
            out[name] = keep
    return out


def data_allowed(names: list[str], split: dict[str, list[int]] | None) -> list | None:
    """``IntraOpProblem.data_allowed`` of a problem whose nodes are ``names``: per node, ``split``'s list or None."""
    if not split:
        return None
    return [split.get(name) for name in names]


def data_start(p: IntraOpProblem, solve) -> list[int] | None:
    """The restricted problem's assignment (``p.data_allowed``; module docstring): solved unbudgeted within
    ``SHARE`` of the time limit (``solve``: ``intra_op.solve_intra_op``), else its greedy choice."""
    if not p.data_allowed:
        return None
    nodes = [n if keep is None else dataclasses.replace(n, allowed=keep) for n, keep in zip(p.nodes, p.data_allowed)]
    q = dataclasses.replace(p, nodes=nodes, memory_budget=None, hint=None, cutoff=None, axis_keys=None,
                            data_allowed=None, transient=None, time_limit_s=max(SHARE * p.time_limit_s, 0.1))
    try:
        return list(solve(q).choice)
    except (InfeasibleError, SolverTimeoutError):
        return greedy_choice(q)
