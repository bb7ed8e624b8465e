"""AUTO's context-parallel candidates: an unnamed mesh re-factored into meshes with a ``"cp"``
axis (``context_axes.py`` splits the sequence there), beside the (d0,) and (dp, tp) ones of
``search.candidate_meshes``.

They exist only where context parallelism can run: the model has a
``scaled_dot_product_attention`` node, the cp size divides every such node's sequence (dim -2 of
its queries and keys) and dim 1 of every input and target that has one
(``context_axes.keep_sequence_split`` splits them there), and the dp size divides the batch (dim 0
of the inputs: ``mesh_solve._axis_roles`` splits it there). The shapes, cp >= 2 and every other
axis >= 2, tp innermost (Megatron's order: tp on the fastest links, then cp, then dp): ``(cp,)``,
``(dp, cp)``, ``(cp, tp)``, ``(dp, cp, tp)``. They are solved after the others, so the best plan so
far bounds them as it bounds the others (``search._candidates``'s cutoff).

The batch rule (``batch_merged``; ``search._merged_wins``): on a microbatch of b rows, a cp mesh
whose dp x cp divides b is not solved when the mesh with its cp axis merged into the data axis,
(dp · cp, tp) (the free 1-D mesh when tp = 1), solved just before it on the same microbatch, gave a
plan that wastes no axis, or could not fit or beat the best plan. That mesh runs the same devices in
the same order, can split the rows where the cp mesh splits the sequence (the same tokens on each
rank, so the same work and activations for every token-wise op), and sums the same gradients over
the same ranks; the cp mesh adds attention's K/V exchange and keeps its K/V buffers. So the cp mesh
cannot beat it (a rule of this cost model, not a proof over every term: a gradient sum over the two
axes pays two ring latencies where the merged axis pays one longer ring, up to (dp - 1)(cp - 1) link
latencies less per sum, far under one K/V exchange). Where the merged mesh's plan wastes an axis (a
tiny model replicated), timed out, or was not solved at this size, the cp mesh is solved: its forced
sequence split may be the plan AUTO ranks first. Context parallelism wins where the rows run out:
b < dp x cp (a long sequence of few rows, or a high accumulation), and there the cp mesh is always
solved. ``AUTOPAR_CP_BATCH_RULE=0`` solves every cp mesh.
"""
from __future__ import annotations

import os

from torch.ops import aten

from autopar.core.mesh import Mesh
from autopar.sharding.strategy import tensor_inputs
from autopar.solver.intra_op import DominatedError

# the batch rule (module docstring); off (``AUTOPAR_CP_BATCH_RULE=0``) for the tests that compare plans
CP_BATCH_RULE: bool = os.environ.get("AUTOPAR_CP_BATCH_RULE", "1") != "0"

SDPA = (aten.scaled_dot_product_attention.default,)


def sequence_lengths(traced) -> list[int]:
    """The sequence length (dim -2 of the queries and keys) of every attention node; empty when
    the model has none."""
    out = []
    for node in traced.gm.graph.nodes:
        if node.op == "call_function" and node.target in SDPA:
            ins = tensor_inputs(node)
            out += [int(a.meta["val"].shape[-2]) for a in ins[:2] if len(a.meta["val"].shape) >= 2]
    return out


def _input_dims(traced) -> list[int]:
    """Dim 1 of every model input and the target that has one (the sequence a cp axis splits)."""
    names = list(traced.inputs) + ([traced.target] if traced.target else [])
    shapes = [tuple(traced.node(n).meta["val"].shape) for n in names]
    return [s[1] for s in shapes if len(s) >= 2 and s[1] > 1]


def _batches(traced) -> list[int]:
    """Dim 0 of every model input and the target (the batch a "dp" axis splits)."""
    names = list(traced.inputs) + ([traced.target] if traced.target else [])
    return [s[0] for s in (tuple(traced.node(n).meta["val"].shape) for n in names) if s]


def _factorisations(n: int) -> list[tuple[int, int, int]]:
    """(dp, cp, tp) with dp * cp * tp = n, cp >= 2."""
    return [(dp, cp, n // (dp * cp)) for dp in range(1, n + 1) if n % dp == 0
            for cp in range(2, n // dp + 1) if (n // dp) % cp == 0]


def cp_meshes(traced, mesh: Mesh) -> list[Mesh]:
    """The cp candidates of an unnamed ``mesh`` for ``traced`` (module docstring), fewest axes first."""
    if traced is None or mesh.named or mesh.size == 1:
        return []
    seqs = sequence_lengths(traced)
    if not seqs:
        return []
    dims, batches = _input_dims(traced), _batches(traced)
    out = []
    for dp, cp, tp in _factorisations(mesh.size):
        if any(s % cp for s in seqs + dims) or any(b % dp for b in batches):
            continue
        sizes = [(n, s) for n, s in (("dp", dp), ("cp", cp), ("tp", tp)) if n == "cp" or s > 1]
        out.append(mesh.reshape(tuple(s for _, s in sizes), tuple(n for n, _ in sizes)))
    return sorted(out, key=lambda m: len(m.shape))


def pipeline_cp_shapes(traced, n: int, pp: int, allowed_tp) -> list[tuple[int, int, int]]:
    """(dp, cp, tp) sub-meshes of ``n`` devices with a cp axis for AUTO's pipelines of ``pp`` stages,
    where the rows run out: for each tensor-parallel degree ``allowed_tp(tp)`` admits, the most data
    parallelism that still gives every stage ``pp`` microbatches of one row per data-parallel rank
    (``B / dp >= pp``), the rest of the devices on cp, offered only when the sub-mesh with that cp
    axis merged into dp could not run ``pp`` microbatches (``B / (dp · cp) < pp``; otherwise it splits
    the rows where cp splits the sequence, without the K/V exchange: the batch rule's argument, here a
    rule that keeps one cp candidate per (pp, tp)). Llama 3's 128K layout is such a sub-mesh: 128
    sequences, pp 16, so dp 8 and cp 16 at tp 8. Empty without attention or where cp divides no
    sequence and input."""
    seqs = sequence_lengths(traced)
    if not seqs:
        return []
    dims, batches = _input_dims(traced), _batches(traced)
    batch = min(batches) if batches else 1
    out = []
    for tp in range(1, n + 1):
        if n % tp or not allowed_tp(tp):
            continue
        rest = n // tp
        dps = [d for d in range(1, rest) if rest % d == 0 and all(b % d == 0 for b in batches) and batch // d >= pp]
        if not dps:
            continue
        dp = max(dps)
        cp = rest // dp
        if cp < 2 or batch // (dp * cp) >= pp or any(x % cp for x in seqs + dims):
            continue
        out.append((dp, cp, tp))
    return out


class MergedAxisWins(DominatedError):
    """A cp mesh the batch rule skips at one microbatch size: its mesh with the cp axis merged into
    the data axis (``merged``: shape, axis names) splits the rows instead and did no worse (module
    docstring). Not a bound across accumulations (fewer rows may need the cp axis), so the mesh is
    dropped at this size only, unless the merged mesh is dropped for good (``search._mark_done``)."""

    def __init__(self, mesh: Mesh, merged: Mesh, rows: int):
        Exception.__init__(self, f"not solved: {rows} rows split over dp x cp = {mesh.size // _tp(mesh)} devices, so "
                           f"mesh {merged.shape} {merged.axis_names} (the cp axis merged into the data axis) does the "
                           "same or better without attention's K/V exchange")
        self.lower_bound, self.cutoff, self.unbudgeted = float("nan"), float("nan"), False
        self.merged = (merged.shape, merged.axis_names)


def _tp(mesh: Mesh) -> int:
    return mesh.shape[mesh.axis_names.index("tp")] if "tp" in mesh.axis_names else 1


def batch_merged(traced, mesh: Mesh) -> Mesh | None:
    """For a cp candidate ``mesh`` of ``cp_meshes`` and the microbatch ``traced``: the candidate with
    its cp axis merged into the data axis when dp x cp divides every input's rows (the batch rule,
    module docstring), else None (also for a mesh without a cp axis, or with the rule off)."""
    if not CP_BATCH_RULE or "cp" not in mesh.axis_names:
        return None
    tp = _tp(mesh)
    rows = mesh.size // tp
    if not all(b % rows == 0 for b in _batches(traced)):
        return None
    return mesh.reshape((rows, tp), ("dp", "tp")) if tp > 1 else mesh.reshape((mesh.size,), ("d0",))
