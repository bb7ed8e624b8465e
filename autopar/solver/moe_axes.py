"""A mesh axis named for expert parallelism (``Mesh((2, 2), axis_names=("dp", "ep"))``).

Such an axis is a data axis for the dense ops (``mesh_solve._axis_roles`` splits every input's
batch on it, as on "dp"), and every ``autopar::moe_experts`` node takes its "ep" strategy on it
(``sharding/rules/moe.py``: experts split, tokens sent to their experts' ranks by all-to-all).
Naming the axis is a request for expert parallelism: a model without an MoE experts node, or
whose experts do not divide over the axis, is refused with a ``PlanError`` saying what to do.
"""
from __future__ import annotations

from autopar.core.mesh import Mesh
from autopar.cost_models.moe import MoeShape, is_moe
from autopar.plan.plan import PlanError

ROLE_EXPERT = ("ep", "expert")
EP_LOCAL = "moe:ep"


def expert_axes(mesh: Mesh) -> list[int]:
    return [i for i, n in enumerate(mesh.axis_names) if n in ROLE_EXPERT]


def expert_axis_choices(traced, cands, mesh: Mesh, allowed: dict) -> None:
    """Keep, for every moe_experts node, the strategies that are "ep" on each expert axis of size > 1."""
    axes = [a for a in expert_axes(mesh) if mesh.shape[a] > 1]
    if not axes:
        return
    names = [mesh.axis_names[a] for a in axes]
    nodes = [n for n in traced.gm.graph.nodes if is_moe(n)]
    if not nodes:
        raise PlanError(f"mesh axis {names[0]!r} asks for expert parallelism, but the model has no mixture-of-experts "
                        "layer autopar keeps as one op (a transformers experts module, see docs/usage.md); name the "
                        "axis 'dp' for data parallelism, or leave the mesh unnamed and let AUTO choose")
    for node in nodes:
        keep = [i for i, st in enumerate(cands.strategies.get(node.name, ()))
                if all(st.local[a] == EP_LOCAL for a in axes)]
        if not keep:
            e = MoeShape(node).experts
            size = 1
            for a in axes:
                size *= mesh.shape[a]
            where = node.meta.get("module_path", "") or node.name
            raise PlanError(f"mesh axis {'×'.join(names)} of size {size} asks for expert parallelism, but the experts "
                            f"of {where} ({e} experts) cannot be split over it (the expert count and the tokens must "
                            f"divide by {size}); use an 'ep' axis whose size divides {e}")
        allowed[node.name] = [i for i in allowed.get(node.name, keep) if i in keep] or keep


def nodes_moe(nodes: dict) -> bool:
    """Whether a plan's node decisions include an MoE experts node."""
    return any(d.op.startswith("autopar.moe_experts") for d in nodes.values())
