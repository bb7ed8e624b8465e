"""The order AUTO tries its candidates in. Order never drops a candidate: every mesh and pipeline is
still solved or bounded. It decides how early a good plan sets the cutoff, and so how many of the
rest are dropped without their full solve, and what a time budget has reached when it ends:

* meshes: ``solve_on_mesh``'s ``DominatedError`` is a proof (the mesh's lower bound reaches the
  cutoff), so their order does not change the plan;
* pipelines: a candidate whose estimate by its reference microbatch's costs is over
  ``pipeline_search.REFERENCE_MARGIN`` x the cutoff is dropped, a heuristic (docs/solver.md): an
  earlier good plan drops more of them, which can change the plan where an estimate misjudges."""
from __future__ import annotations

import math

from autopar.plan.plan import Plan
from autopar.solver.intra_op import DominatedError


def node_order(tp: int, per_node: int) -> tuple[bool, int]:
    """A clustered mesh's (dp, tp) factorisations: tensor parallelism inside a node first, widest first,
    then across nodes, narrowest first (Narayanan et al., SC'21, takeaway 1: tensor parallelism up to
    the node's size)."""
    inside = per_node % tp == 0
    return not inside, -tp if inside else tp


def tp_of(shape: tuple, names: tuple) -> int:
    """The tensor-parallel degree of a candidate mesh (its shape and axis names): its "tp" axis, 1 without one."""
    return shape[names.index("tp")] if "tp" in names else 1


def flat_steps(outcomes: dict, step_time) -> dict[int, float]:
    """tp -> the fastest step (``step_time(plan)``) of the flat meshes solved with that tensor-parallel
    degree, from ``outcomes`` (mesh key -> plan or error); a mesh the cutoff dropped counts at its proven
    lower bound. Meshes with a "cp" axis and failures without a bound are left out."""
    out: dict[int, float] = {}
    for (shape, names), got in outcomes.items():
        if "cp" in names:
            continue
        tp = tp_of(shape, names)
        step = step_time(got) if isinstance(got, Plan) else got.lower_bound if isinstance(got, DominatedError) \
            else None
        if step is not None:
            out[tp] = min(out.get(tp, math.inf), step)
    return out


def by_flat_steps(cands: list, flat: dict[int, float] | None) -> list:
    """Pipeline candidates by the step of the flat mesh with the same tensor-parallel degree
    (``flat_steps``), fastest first (stable: within one degree, the order given). A pipeline of pp stages
    on (dp, tp) runs the per-device work of the flat (pp·dp, tp) mesh plus its bubble, with less gradient
    traffic: the flat meshes, solved first, rank the tensor-parallel degrees for it."""
    if not flat:
        return cands
    return sorted(cands, key=lambda c: flat.get(tp_of(c.sub.shape, c.sub.axis_names), math.inf))
