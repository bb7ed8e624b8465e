"""Cut full parameters/buffers into this rank's pieces (chunk-aware, first axis outermost)."""
from __future__ import annotations

import torch

from autopar.sharding.placements import Shard, piece_of


def local_piece(t: torch.Tensor, spec, coords: tuple, mesh_shape: tuple) -> torch.Tensor:
    """This rank's piece of the full tensor ``t`` under ``spec`` (Partial/Replicate: whole)."""
    out = t
    for a, p in enumerate(spec):
        if isinstance(p, Shard):
            n = mesh_shape[a]
            blocks = out.chunk(p.chunks, p.dim) if p.chunks > 1 else (out,)
            out = torch.cat([b.chunk(n, p.dim)[piece_of(coords[a], n, i, p.zigzag)] for i, b in enumerate(blocks)],
                            p.dim)
    return out


def assemble(pieces: dict[tuple, torch.Tensor], spec, mesh_shape: tuple) -> torch.Tensor:
    """Inverse of ``local_piece``: the full tensor from every rank's piece (keyed by coords)."""
    ndim_mesh = len(mesh_shape)

    def build(axis: int, fixed: tuple) -> torch.Tensor:
        if axis == ndim_mesh:
            return pieces[fixed]
        p = spec[axis]
        if not isinstance(p, Shard):
            return build(axis + 1, fixed + (0,))
        parts = [build(axis + 1, fixed + (i,)) for i in range(mesh_shape[axis])]
        return join_pieces(parts, p)

    return build(0, ())


def join_pieces(parts: list[torch.Tensor], p: Shard) -> torch.Tensor:
    """The tensor whose pieces under ``p`` over an axis of ``len(parts)`` ranks are ``parts`` (rank
    order): what an all-gather along ``p`` returns."""
    if p.chunks == 1:
        return torch.cat(parts, p.dim)
    n = len(parts)
    per = [q.chunk(p.chunks, p.dim) for q in parts]
    return torch.cat([per[piece_of(j, n, b, p.zigzag)][b] for b in range(p.chunks) for j in range(n)], p.dim)
