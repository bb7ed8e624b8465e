"""Where this rank's piece of a tensor lies in the full tensor, as boxes (for sharded checkpoints).

A spec cuts each dimension independently, so the piece ``local_piece`` returns is the product, over
dimensions, of the global index runs the rank holds along each one (``runs``): one run per
dimension for ``Shard(dim)`` and ``Replicate``, ``chunks`` runs for ``Shard(dim, chunks)`` (the
fused-QKV layout; ``Z(dim)``, the zig-zag order, mirrors the odd ones). Every combination of one
run per dimension is a *box*: a rectangle of the full
tensor (global offsets, sizes) stored at some local offsets of the piece.

ZeRO shards hold a flat range ``[lo, hi)`` of the piece's row-major flattening. ``flat_rects``
cuts such a range into rectangles of the piece, each contiguous in flat order (a partial row,
full rows, a partial row, recursively), so each is a view of the shard; ``boxes`` then cuts each
rectangle at the runs' borders.
"""
from __future__ import annotations

import itertools
import math

from autopar.sharding.placements import Shard, piece_of


def _take(runs: list[tuple[int, int]], start: int, stop: int) -> list[tuple[int, int]]:
    """The runs (global start, length) covering positions ``[start, stop)`` of the concatenated ``runs``."""
    out, at = [], 0
    for g, n in runs:
        s, e = max(start, at), min(stop, at + n)
        if s < e:
            out.append((g + s - at, e - s))
        at += n
    return out


def _chunk_bounds(length: int, parts: int, index: int) -> tuple[int, int]:
    """``torch.chunk(parts)[index]``'s bounds in a dimension of ``length`` (as ``local_piece`` cuts)."""
    size = math.ceil(length / parts) if length else 0
    return min(index * size, length), min((index + 1) * size, length)


def runs(shape, spec, coords, mesh_shape) -> list[list[tuple[int, int]]]:
    """Per dimension of a tensor of global ``shape``, the runs (global start, length) of the indices
    this rank's piece holds, in the piece's order (``local_piece``'s cut, axis 0 first)."""
    out = [[(0, n)] if n else [] for n in shape]
    for a, p in enumerate(spec):
        if not isinstance(p, Shard):
            continue
        dim = p.dim % len(shape)
        held = out[dim]
        length = sum(n for _, n in held)
        picked = []
        for b in range(p.chunks):
            blo, bhi = _chunk_bounds(length, p.chunks, b) if p.chunks > 1 else (0, length)
            lo, hi = _chunk_bounds(bhi - blo, mesh_shape[a], piece_of(coords[a], mesh_shape[a], b, p.zigzag))
            picked += _take(held, blo + lo, blo + hi)
        out[dim] = picked
    return out


def boxes(held: list[list[tuple[int, int]]], lo=None, sizes=None) -> list[tuple[tuple, tuple, tuple]]:
    """(global offsets, local offsets, sizes) of every box of the piece region ``[lo, lo + sizes)``
    (default: the whole piece); ``held`` is ``runs``' answer."""
    per_dim = []
    for d, rs in enumerate(held):
        total = sum(n for _, n in rs)
        a = lo[d] if lo is not None else 0
        b = a + sizes[d] if sizes is not None else total
        parts, at = [], 0
        for g, n in rs:
            s, e = max(a, at), min(b, at + n)
            if s < e:
                parts.append((g + s - at, s, e - s))
            at += n
        per_dim.append(parts)
    return [(tuple(p[0] for p in combo), tuple(p[1] for p in combo), tuple(p[2] for p in combo))
            for combo in itertools.product(*per_dim)]


def slices(offsets, sizes) -> tuple:
    """The index of a box: ``t[slices(offsets, sizes)]``."""
    return tuple(slice(o, o + n) for o, n in zip(offsets, sizes))


def flat_rects(shape, lo: int, hi: int) -> list[tuple[tuple, tuple, int]]:
    """(offsets, sizes, flat start) of rectangles of a tensor of ``shape`` covering the flat range
    ``[lo, hi)`` in row-major order; each rectangle is one contiguous flat run."""
    if lo >= hi:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    r0, r1 = lo // inner, hi // inner
    out = []

    def rows_of(row: int, a: int, b: int):
        for off, sz, start in flat_rects(shape[1:], a, b):
            out.append(((row,) + off, (1,) + sz, row * inner + start))

    if r0 == r1:
        rows_of(r0, lo - r0 * inner, hi - r0 * inner)
        return out
    first = r0
    if lo % inner:
        rows_of(r0, lo % inner, inner)
        first = r0 + 1
    if r1 > first:
        out.append(((first,) + (0,) * (len(shape) - 1), (r1 - first,) + tuple(shape[1:]), first * inner))
    if hi % inner:
        rows_of(r1, 0, hi % inner)
    return out
