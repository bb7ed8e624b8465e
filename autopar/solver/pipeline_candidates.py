"""Which pipelines a request tries (``pipeline_search.pipeline_plans``): a named mesh with a ``pp``
axis fixes pp and the sub-mesh; ``pipeline_stage`` tags fix pp = max tag + 1 and the cuts they name;
AUTO on an unnamed mesh tries every pp >= 2 dividing the devices times every (dp, tp) factorisation of
the rest, tp inside a node when ``gpus_per_node`` is set, and, for a model with attention whose rows
run out, one (dp, cp, tp) per tp (``cp_candidates.pipeline_cp_shapes``)."""
from __future__ import annotations

from dataclasses import dataclass

from autopar.core.context import ParallelMode
from autopar.core.mesh import Mesh
from autopar.solver.candidate_order import tp_of
from autopar.solver.cp_candidates import pipeline_cp_shapes
from autopar.solver.pipeline_fit import PipelineRequestError


@dataclass
class PipelineCandidate:
    pp: int
    sub: Mesh                 # the (dp, [cp,] tp) sub-mesh every stage is solved on
    full: Mesh                # the plan's mesh, pp axis first
    fixed: dict               # module name -> stage index (pipeline_stage tags)
    allow_idle: bool = False  # a requested pipeline may leave a stage without parameters when no cut avoids it


def _sub_meshes(mesh: Mesh, n: int) -> list[Mesh]:
    make = lambda shape, names: Mesh(shape, names, mesh.device, mesh.gpus_per_node, mesh.memory_gb)  # noqa: E731
    out = [make((n,), ("dp",) if n > 1 else ("tp",))]
    in_node = lambda tp: mesh.gpus_per_node is None or mesh.gpus_per_node % tp == 0  # noqa: E731
    for dp in range(2, n):
        if n % dp == 0 and in_node(n // dp):
            out.append(make((dp, n // dp), ("dp", "tp")))
    if n > 1 and in_node(n):
        out.append(make((n,), ("tp",)))
    return out


def _cp_sub_meshes(traced, mesh: Mesh, n: int, pp: int) -> list[Mesh]:
    """AUTO's sub-meshes with a cp axis (``cp_candidates.pipeline_cp_shapes``), axes of size 1 left out. On a
    mesh with nodes only at the widest tensor parallelism a node holds (Megatron's order: tp fills the
    node's links first, cp goes across nodes, as in Llama 3's 128K layout, tp 8 x cp 16): a narrower tp
    with cp would be one more candidate per depth, solved at every ZeRO stage and recompute choice."""
    widest = max(t for t in range(1, n + 1) if n % t == 0 and (mesh.gpus_per_node or n) % t == 0)
    at_node = lambda tp: mesh.gpus_per_node is None or tp == widest  # noqa: E731
    out = []
    for dp, cp, tp in pipeline_cp_shapes(traced, n, pp, at_node):
        sizes = [(a, k) for a, k in (("dp", dp), ("cp", cp), ("tp", tp)) if a == "cp" or k > 1]
        out.append(Mesh(tuple(k for _, k in sizes), tuple(a for a, _ in sizes), mesh.device, mesh.gpus_per_node,
                        mesh.memory_gb))
    return out


def _full_mesh(mesh: Mesh, pp: int, sub: Mesh) -> Mesh:
    return Mesh((pp,) + sub.shape, ("pp",) + sub.axis_names, mesh.device, mesh.gpus_per_node, mesh.memory_gb)


def pipeline_candidates(traced, mesh: Mesh, mode: ParallelMode, tags: dict) -> tuple[list[PipelineCandidate], bool]:
    """(candidates, forced): forced means the request names a pipeline (pp axis or stage tags)."""
    if mode in (ParallelMode.DATA, ParallelMode.STAND_ALONE, ParallelMode.HYBRID):
        return [], False
    named_pp = mesh.named and "pp" in mesh.axis_names
    if named_pp:
        if mesh.axis_names[0] != "pp":
            raise PipelineRequestError(f"the 'pp' axis must be the first mesh axis (got {mesh.axis_names}): stages "
                                       "are the outermost split, e.g. Mesh((2, 2), axis_names=('pp', 'tp'))")
        pp = mesh.shape[0]
        need = max(tags.values(), default=0) + 1
        if tags and need != pp:
            raise PipelineRequestError(f"pipeline_stage tags name {need} stages but the mesh's pp axis has {pp}")
        rest = mesh.shape[1:] or (1,)
        names = mesh.axis_names[1:] or ("tp",)
        sub = Mesh(rest, names, mesh.device, mesh.gpus_per_node, mesh.memory_gb)
        full = mesh if mesh.shape[1:] else _full_mesh(mesh, pp, sub)
        return ([PipelineCandidate(pp, sub, full, tags, True)] if pp > 1 else []), pp > 1
    if tags:
        pp = max(tags.values()) + 1
        if pp == 1:
            return [], False
        if mesh.size % pp:
            raise PipelineRequestError(f"pipeline_stage tags name {pp} stages but {mesh.size} devices do not split "
                                       f"into {pp} equal stages")
        subs = _sub_meshes(mesh, mesh.size // pp)
        return [PipelineCandidate(pp, s, _full_mesh(mesh, pp, s), tags, True) for s in subs], True
    if mode != ParallelMode.AUTO or mesh.named or mesh.size == 1:
        return [], False
    out = []
    for pp in range(2, mesh.size + 1):
        if mesh.size % pp == 0:
            subs = _sub_meshes(mesh, mesh.size // pp) + _cp_sub_meshes(traced, mesh, mesh.size // pp, pp)
            out += [PipelineCandidate(pp, s, _full_mesh(mesh, pp, s), {}) for s in subs]
    if mesh.gpus_per_node:              # the widest tensor parallelism inside a node first (``node_first``)
        out.sort(key=node_first)
    return out, False


def node_first(cand: PipelineCandidate) -> tuple[int, int]:
    """The order AUTO tries a clustered mesh's pipeline candidates in: tensor parallelism as wide as a
    node first, then fewer stages (Narayanan et al., SC'21, takeaway 1: on g-GPU servers tensor
    parallelism up to degree g, pipeline parallelism across servers). Every candidate is still
    tried; the order decides what a time budget has reached when it ends."""
    return -tp_of(cand.sub.shape, cand.sub.axis_names), cand.pp
