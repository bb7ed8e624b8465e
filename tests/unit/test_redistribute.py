"""The redistribution table, checked on real tensors: every (src, dst) pair of specs over a
2-D mesh, applied piece by piece on simulated ranks, gives dst's pieces of the same tensor."""
from __future__ import annotations

import itertools

import pytest
import torch

from autopar.sharding.placements import P, R, Shard
from autopar.sharding.redistribute import redistribute_steps
from autopar.sharding.shard_params import assemble, local_piece

MESH = (2, 2)
RANKS = [(i, j) for i in range(2) for j in range(2)]


def _simulate(pieces: dict, steps) -> dict:
    """Run redistribution steps on per-rank pieces without processes (exact collectives)."""
    for st in steps:
        a = st.axis
        groups = {}
        for c in RANKS:
            key = tuple(v for i, v in enumerate(c) if i != a)
            groups.setdefault(key, []).append(c)
        new = {}
        for members in groups.values():
            members = sorted(members, key=lambda c: c[a])
            vals = [pieces[c] for c in members]
            for c in members:
                r = c[a]
                if st.kind == "all_gather":
                    if st.chunks == 1:
                        new[c] = torch.cat(vals, st.dim)
                    else:
                        per = [v.chunk(st.chunks, st.dim) for v in vals]
                        new[c] = torch.cat([torch.cat([p[b] for p in per], st.dim) for b in range(st.chunks)], st.dim)
                elif st.kind == "all_reduce":
                    new[c] = sum(vals)
                elif st.kind == "reduce_scatter":
                    total = sum(vals)
                    blocks = total.chunk(st.chunks, st.dim) if st.chunks > 1 else [total]
                    new[c] = torch.cat([b.chunk(len(vals), st.dim)[r] for b in blocks], st.dim)
                elif st.kind == "local_slice":
                    blocks = pieces[c].chunk(st.chunks, st.dim) if st.chunks > 1 else [pieces[c]]
                    new[c] = torch.cat([b.chunk(len(vals), st.dim)[r] for b in blocks], st.dim)
                elif st.kind == "all_to_all":
                    new[c] = torch.cat([v.chunk(len(vals), st.dst_dim)[r] for v in vals], st.dim)
                elif st.kind == "to_partial":
                    new[c] = pieces[c] if r == 0 else torch.zeros_like(pieces[c])
        pieces = new
    return pieces


def _pieces(full, spec):
    """Per-rank pieces; a Partial axis spreads the value as v/2 + v/2 (sum is the value)."""
    out = {}
    for c in RANKS:
        t = local_piece(full, tuple(R if p == P else p for p in spec), c, MESH)
        n_partial = sum(1 for p in spec if p == P)
        out[c] = t / (2 ** n_partial)
    return out


PLACEMENTS = [R, P, Shard(0), Shard(1), Shard(1, 2)]
SPECS = [s for s in itertools.product(PLACEMENTS, repeat=2)]


@pytest.mark.parametrize("src", SPECS, ids=lambda s: "".join(str(p) for p in s))
def test_every_redistribution_gives_the_destination_pieces(src):
    full = torch.arange(8 * 8, dtype=torch.float64).reshape(8, 8)
    for dst in SPECS:
        if P in dst:
            continue
        got = _simulate(_pieces(full, src), redistribute_steps(src, dst))
        for c in RANKS:
            want = local_piece(full, dst, c, MESH)
            assert torch.equal(got[c], want), f"{src} -> {dst} on rank {c}: {redistribute_steps(src, dst)}"


def test_assemble_inverts_local_piece():
    full = torch.randn(8, 12)
    for spec in [(Shard(0), Shard(0)), (Shard(1, 2), Shard(0)), (R, Shard(1)), (Shard(1), Shard(1, 2))]:
        pieces = {c: local_piece(full, spec, c, MESH) for c in RANKS}
        assert torch.equal(assemble(pieces, spec, MESH), full)
