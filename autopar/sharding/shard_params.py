"""Cut full parameters/buffers into this rank's pieces (chunk-aware, first axis outermost)."""
from __future__ import annotations

import torch

from autopar.sharding.placements import Shard


def local_piece(t: torch.Tensor, spec, coords: tuple, mesh_shape: tuple) -> torch.Tensor:
    """This rank's piece of the full tensor ``t`` under ``spec`` (Partial/Replicate: whole)."""
    out = t
    for a, p in enumerate(spec):
        if isinstance(p, Shard):
            n = mesh_shape[a]
            blocks = out.chunk(p.chunks, p.dim) if p.chunks > 1 else (out,)
            out = torch.cat([b.chunk(n, p.dim)[coords[a]] for b in blocks], p.dim)
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
        if p.chunks == 1:
            return torch.cat(parts, p.dim)
        per = [q.chunk(p.chunks, p.dim) for q in parts]
        return torch.cat([torch.cat([q[b] for q in per], p.dim) for b in range(p.chunks)], p.dim)

    return build(0, ())
