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
"""
from __future__ import annotations

from torch.ops import aten

from autopar.core.mesh import Mesh
from autopar.sharding.strategy import tensor_inputs

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
