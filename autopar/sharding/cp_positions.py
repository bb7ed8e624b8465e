"""Which sequence positions a context-parallel rank holds, and the tiles of a ring block.

Positions follow the placement (``sharding/placements.py``): ``Shard(dim)`` on each cp axis (the
contiguous split, first axis outermost) or ``Z(dim)`` (the zig-zag order: rank ``r`` of ``n``
holds chunks ``r`` and ``2n-1-r`` of ``2n``). ``held`` answers by cutting (and gathering) an
``arange`` exactly as the runtime cuts and gathers the tensors (``local_piece``, ``join_pieces``),
so the attention's causal mask and block skipping agree with the data by construction.

A ring block (this rank's queries against one rank's keys) is cut into *tiles*: the pairs of runs
of consecutive positions (``runs``) of the queries and of the keys. Under the causal mask a tile
is hidden (every key after every query: skipped), ``"full"`` (every key at or before every
query), ``"causal"`` (queries and keys the same run: the top-left causal square) or ``"partial"``
(anything else, run with an explicit mask). The contiguous split gives one tile per block; the
zig-zag split four, of which the hidden ones and the half-visible blocks' halves are what balance
the ranks' work (``tile_work``).

It sits below both of its users: ``collectives/attention_cp.py`` runs these tiles and
``cost_models/cp_tiles.py`` prices the same tiles.
"""
from __future__ import annotations

import torch

from autopar.sharding.placements import Shard
from autopar.sharding.shard_params import join_pieces, local_piece


def seq_shard(zigzag: bool) -> Shard:
    """The placement of a 1-D sequence on every cp axis."""
    return Shard(0, 2, True) if zigzag else Shard(0)


def held(total: int, sizes: list[int], coords: list[int], zigzag: bool, gathered: tuple = (),
         device=None) -> torch.Tensor:
    """Global positions, in local order, of the sequence of ``total`` a rank at ``coords`` (over cp
    axes of ``sizes``) holds, after all-gathering over the axes ``gathered`` (indices into
    ``sizes``, in the order the gathers run)."""
    spec = [seq_shard(zigzag)] * len(sizes)
    if not gathered:
        return local_piece(torch.arange(total, device=device), spec, tuple(coords), tuple(sizes))
    a = gathered[-1]
    parts = [held(total, sizes, list(coords[:a]) + [k] + list(coords[a + 1:]), zigzag, gathered[:-1], device)
             for k in range(sizes[a])]
    return join_pieces(parts, spec[a])


def runs(pos: torch.Tensor) -> list[slice]:
    """Maximal runs of consecutive increasing positions, as slices of ``pos``."""
    if pos.numel() == 0:
        return []
    at = [0] + (torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1).tolist() + [len(pos)]
    return [slice(a, b) for a, b in zip(at, at[1:])]


def _cut(kpos: torch.Tensor, run: slice, cuts: set[int]) -> list[slice]:
    """``run`` split before every position in ``cuts``."""
    first = int(kpos[run.start])
    at = [run.start] + [run.start + c - first for c in sorted(cuts) if first < c <= int(kpos[run.stop - 1])]
    return [slice(a, b) for a, b in zip(at, at[1:] + [run.stop])]


def tiles(qpos: torch.Tensor, kpos: torch.Tensor, causal: bool) -> list[tuple[slice, slice, str]]:
    """The tiles (query slice, key slice, kind) of one block that are not hidden (module doc). Key
    runs are cut where a query run starts and ends, so a query run sees whole tiles: every key
    before it (one ``"full"`` tile where they are adjacent) and its own ``"causal"`` square."""
    if not causal:
        return [(slice(0, len(qpos)), slice(0, len(kpos)), "full")]
    qpos, kpos = qpos.cpu(), kpos.cpu()     # bookkeeping: no device syncs per position
    qruns = runs(qpos)
    cuts = {int(qpos[s.start]) for s in qruns} | {int(qpos[s.stop - 1]) + 1 for s in qruns}
    kruns = [piece for r in runs(kpos) for piece in _cut(kpos, r, cuts)]
    out = []
    for qs in qruns:
        q0, q1 = int(qpos[qs.start]), int(qpos[qs.stop - 1])
        row: list[tuple[slice, slice, str]] = []
        for ks in kruns:
            k0, k1 = int(kpos[ks.start]), int(kpos[ks.stop - 1])
            if k0 > q1:
                continue
            kind = "full" if k1 <= q0 else "causal" if (k0, k1) == (q0, q1) else "partial"
            if kind == "full" and row and row[-1][2] == "full" and row[-1][1].stop == ks.start:
                row[-1] = (qs, slice(row[-1][1].start, ks.stop), "full")
            else:
                row.append((qs, ks, kind))
        out += row
    return out


def tile_work(block_tiles: list[tuple[slice, slice, str]]) -> int:
    """(query, key) pairs a block's tiles compute: all of a full or partial tile (an explicit mask
    still computes the hidden entries), the lower triangle of a causal one (the flash kernel)."""
    total = 0
    for qs, ks, kind in block_tiles:
        rows, cols = qs.stop - qs.start, ks.stop - ks.start
        total += rows * (rows + 1) // 2 if kind == "causal" else rows * cols
    return total
