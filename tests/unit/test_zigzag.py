"""The zig-zag order of causal context parallelism (issue 35): the placement ``Z(dim)``, the pieces
it cuts, the ring's tiles under it, the work per rank (balanced within 10 %), its costing and the
solver's choice of it."""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar import Shard
from autopar.collectives.attention_cp import causal_flops_per_rank, zigzag_chunks
from autopar.sharding.cp_positions import held, tile_work, tiles
from autopar.cost_models.context_parallel import block_shares, imbalance, rank_shares, ring_time
from autopar.sharding.boxes import runs
from autopar.sharding.placements import R, parse_placement, piece_of, zigzag_of
from autopar.sharding.redistribute import redistribute_steps
from autopar.sharding.shard_params import assemble, local_piece

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cp_models import TinyGPT, encoder, token_loss, tokens  # noqa: E402

Z = Shard(0, 2, True)


def _written_out(rank: int, n: int, seq: int) -> list[int]:
    """Chunks r and 2n-1-r of 2n, written out here."""
    c = seq // (2 * n)
    return list(range(rank * c, (rank + 1) * c)) + list(range((2 * n - 1 - rank) * c, (2 * n - rank) * c))


# ---- the placement ----------------------------------------------------------------------------

def test_text_forms_round_trip():
    for p in (Shard(1), Shard(0, 3), Shard(1, 2, True), Shard(0, 4, True)):
        assert parse_placement(str(p)) == p
    assert str(Shard(1, 2, True)) == "Z(1)" and str(Shard(0, 6, True)) == "Z(0,6)"
    assert zigzag_of(Shard(0, 3)) == Shard(0, 6, True) and zigzag_of(R) == R and zigzag_of(Z) == Z
    with pytest.raises(ValueError, match="even number of chunks"):
        Shard(1, 3, True)


@pytest.mark.parametrize("mesh", [(2,), (4,), (8,), (2, 2), (2, 4)])
def test_pieces_are_chunks_r_and_2n_minus_1_minus_r(mesh):
    """``local_piece`` over one axis or several (first axis outermost) gives the combined rank r of
    n its chunks r and 2n-1-r of 2n; ``assemble``, ``runs`` (checkpoint boxes) and ``held`` agree."""
    seq, n = 64, 1
    for m in mesh:
        n *= m
    full = torch.arange(seq)
    spec = (Z,) * len(mesh)
    pieces = {}
    for r, coords in enumerate(itertools.product(*[range(m) for m in mesh])):
        piece = local_piece(full, spec, coords, mesh)
        assert piece.tolist() == _written_out(r, n, seq), (coords, piece)
        assert [i for g, k in runs((seq,), spec, coords, mesh)[0] for i in range(g, g + k)] == piece.tolist()
        assert held(seq, list(mesh), list(coords), True).tolist() == piece.tolist()
        pieces[coords] = piece
    assert torch.equal(assemble(pieces, spec, mesh), full)


def test_a_flattened_sequence_keeps_the_order_per_row():
    """``[B, T]`` in ``Z(1)`` flattened is ``[B*T]`` in ``Z(0, 2B)``: every row halved, mirrored alike."""
    b, t, n = 3, 16, 4
    x = torch.arange(b * t).view(b, t)
    for r in range(n):
        rows = local_piece(x, (Shard(1, 2, True),), (r,), (n,))
        flat = local_piece(x.flatten(), (zigzag_of(Shard(0, b)),), (r,), (n,))
        assert torch.equal(rows.flatten(), flat)


def test_redistribution_steps_carry_the_order():
    steps = redistribute_steps((Shard(1, 2, True),), (R,))
    assert [(s.kind, s.chunks, s.zigzag) for s in steps] == [("all_gather", 2, True)]
    steps = redistribute_steps((R,), (Shard(1, 2, True),))
    assert [(s.kind, s.zigzag) for s in steps] == [("local_slice", True)]
    assert piece_of(1, 4, 0, True) == 1 and piece_of(1, 4, 1, True) == 2 and piece_of(1, 4, 1, False) == 1


# ---- the work per rank ------------------------------------------------------------------------

def _ring_work(n: int, seq: int, zigzag: bool) -> list[int]:
    """(query, key) pairs each rank's ring computes: its queries against every rank's keys, tile by
    tile as ``_RingAttention`` visits them (``cp_positions.tiles``)."""
    return [sum(tile_work(tiles(held(seq, [n], [r], zigzag), held(seq, [n], [s], zigzag), True)) for s in range(n))
            for r in range(n)]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zigzag_balances_causal_work_within_ten_percent(n):
    """Counted two ways: the visible pairs of each rank's queries (``causal_flops_per_rank``) and the
    pairs the ring's tiles compute. Zig-zag: within 10 % (exactly equal); contiguous: the last rank
    about (2n-1)/n of the mean, the first 1/n."""
    seq, d = 1024, 64
    whole = causal_flops_per_rank(seq, [[0]], 1, d)[0]
    flops = causal_flops_per_rank(seq, [list(zigzag_chunks(r, n)) for r in range(n)], 2 * n, d)
    assert sum(flops) == whole and max(flops) <= 1.1 * min(flops), flops
    zz, contiguous = _ring_work(n, seq, True), _ring_work(n, seq, False)
    assert sum(zz) == sum(contiguous) == seq * (seq + 1) // 2          # no hidden entry computed
    assert max(zz) <= 1.1 * min(zz), zz
    assert max(contiguous) > 1.5 * min(contiguous), contiguous
    assert [2 * d * w for w in zz] == flops                              # the same pairs as counted above


def test_zigzag_ring_tiles():
    """Rank 1 of 4, 16 positions: its own block is two causal squares and one full tile (its tail's
    queries see its head's keys); an earlier rank's keys: the head half, seen by every query; a later
    rank's: seen by the tail's queries only. The whole sequence's keys (the gather form) are cut at
    the queries' runs."""
    q = held(16, [4], [1], True)
    assert q.tolist() == [2, 3, 12, 13]
    kinds = lambda s: [(t[0].start, t[0].stop, t[1].start, t[1].stop, t[2]) for t in tiles(q, held(16, [4], [s], True), True)]
    assert kinds(1) == [(0, 2, 0, 2, "causal"), (2, 4, 0, 2, "full"), (2, 4, 2, 4, "causal")]
    assert kinds(0) == [(0, 2, 0, 2, "full"), (2, 4, 0, 2, "full")]
    assert kinds(2) == [(2, 4, 0, 4, "full")]          # both key chunks visible: one tile, one kernel call
    # the gather form's whole keys, cut at the query runs: what precedes each run in one tile, then its square
    gathered = [(t[0].start, t[1].start, t[1].stop, t[2]) for t in tiles(q, torch.arange(16), True)]
    assert gathered == [(0, 0, 2, "full"), (0, 2, 4, "causal"), (2, 0, 12, "full"), (2, 12, 14, "causal")]


# ---- costs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 4, 8])
def test_costs_charge_the_balanced_work(n):
    seq = 64 * n
    shares = rank_shares(n, seq, True, zigzag=True)
    assert sum(shares) == pytest.approx(1.0) and max(shares) == pytest.approx(min(shares))
    assert imbalance(n, seq, True, zigzag=True) == pytest.approx(1.0)
    assert imbalance(n, seq, True) == pytest.approx((2 * n - 1) / n, rel=0.02)
    assert block_shares(n, seq, True, zigzag=True)[0][1] == pytest.approx(block_shares(n, seq, True, zigzag=True)[1][0])
    fwd = 1.0
    assert ring_time(fwd, 0.0, n, seq, True, 0.0, 0.0, overlap=True, zigzag=True).compute_fwd < \
        ring_time(fwd, 0.0, n, seq, True, 0.0, 0.0, overlap=True).compute_fwd


# ---- the solver's choice ------------------------------------------------------------------------

def _plan(model, ann=None, seq=64):
    x, y = tokens(2, seq=seq)
    autopar.shard_input(0, ann or {"cp": Shard(1)})
    try:
        return autopar.plan(model, autopar.Mesh((4,), axis_names=("cp",)), example_inputs=(x,), loss_fn=token_loss,
                            example_target=y, mode="semi_auto")
    finally:
        autopar.clear_annotations()


def test_causal_attention_takes_the_zigzag_order_and_bidirectional_keeps_pieces():
    plan = _plan(TinyGPT())
    assert {str(s) for s in plan.inputs.values()} == {"[Z(1)]"}
    attn = [n for n in plan.nodes.values() if "scaled_dot_product_attention" in n.op]
    assert attn and all(str(n.inputs[0]) == "[Z(2)]" for n in attn)
    assert "in the zig-zag order" in plan.report()
    assert {str(s) for s in _plan(encoder()).inputs.values()} == {"[S(1)]"}
    # a sequence that 2 x cp does not divide keeps contiguous pieces
    assert {str(s) for s in _plan(TinyGPT(seq=36), seq=36).inputs.values()} == {"[S(1)]"}


def test_zigzag_asked_where_nothing_can_take_it_is_a_clear_error():
    with pytest.raises(autopar.PlanError, match=r"zig-zag order .*2 x 4 = 8 chunks.*Shard\(1\)"):
        _plan(TinyGPT(seq=36), {"cp": Shard(1, 2, zigzag=True)}, seq=36)
