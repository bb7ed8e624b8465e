"""One cp rank's attention priced as the runtime's fused tiles (``cost_models/cp_tiles.py``), checked
against the runtime's own tile cutter, the whole op's cost and the balance of the placements."""
from __future__ import annotations

import math

import pytest
import torch
import torch.fx as fx
from torch.ops import aten

from autopar.cost_models.compute import node_cost
from autopar.cost_models.context_parallel import gather_time
from autopar.cost_models.cp_tiles import (ZERO, AttnShape, Tile, around, block_tiles, cp_compute, cut_block_tiles,
                                          cut_gather_tiles, gather_compute, gather_rank_time, gather_tiles, kernel,
                                          per_op, ring_compute, tiles_time)
from autopar.cost_models.devices import get_device
from autopar.sharding.placements import Shard
from autopar.sharding.strategy import Strategy
from autopar.solver.cp_costs import cp_time
from autopar.solver.strategy_prices import Costing, split_cost

H100 = get_device("h100")


def _sdpa(heads, kv_heads, seq, dim=128, dtype=torch.bfloat16, causal=True, mask=False):
    g = fx.Graph()
    shapes = [(1, heads, seq, dim), (1, kv_heads, seq, dim), (1, kv_heads, seq, dim)]
    ins = []
    for name, shape in zip("qkv", shapes):
        p = g.placeholder(name)
        p.meta["val"] = torch.empty(shape, device="meta", dtype=dtype, requires_grad=True)
        ins.append(p)
    if mask:
        m = g.placeholder("mask")
        m.meta["val"] = torch.empty((seq, seq), device="meta", dtype=torch.bool)
        ins.append(m)
    node = g.call_function(aten.scaled_dot_product_attention.default, tuple(ins),
                           {"is_causal": causal, "enable_gqa": kv_heads != heads})
    node.meta["val"] = torch.empty(shapes[0], device="meta", dtype=dtype)
    g.output(node)
    return node


def _shape(heads, kv_heads, seq, causal=True, dtype=torch.bfloat16):
    return AttnShape(heads, kv_heads, seq, 128, 128, dtype, True, causal)


def _balanced(node, n, device=H100):
    """The balanced share: the whole op's cost over ``n`` ranks (what the model charged before)."""
    return node_cost(node, device).scaled(n)


# ---- the tiles are the runtime's -----------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("zigzag", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_closed_forms_are_the_runtimes_cut(n, zigzag, causal):
    """``gather_tiles`` / ``block_tiles`` (closed forms) = ``sharding.cp_positions.tiles`` on the
    rank's positions (what ``collectives/attention_cp.py`` runs), for every rank and block."""
    seq = 8 * n * 5
    for r in range(n):
        if causal:          # without a mask the gather form is one SDPA call, not tiles
            assert gather_tiles(seq, n, r, zigzag, causal) == cut_gather_tiles(seq, (n,), (r,), zigzag, causal)
        for j in range(n):
            assert block_tiles(seq, n, r, j, zigzag, causal) == cut_block_tiles(seq, (n,), (r,), j, zigzag, causal)


def test_tiles_cover_every_visible_pair_once():
    """A rank's tiles compute its queries' visible pairs: summed over the ranks, the causal op's."""
    seq, n = 96, 4
    visible = seq * (seq + 1) // 2
    for zigzag in (True, False):
        assert sum(t.entries for r in range(n) for t in gather_tiles(seq, n, r, zigzag, True)) == visible
        assert sum(t.entries for r in range(n) for j in range(n) for t in block_tiles(seq, n, r, j, zigzag, True)) \
            == visible


def test_uneven_chunks_name_the_sequence_and_the_fix():
    with pytest.raises(ValueError, match=r"sequence of 100 positions does not split into 8 equal chunks.*"
                                         r"cp size that divides it"):
        gather_tiles(100, 4, 0, True, True)


# ---- against the whole op ------------------------------------------------------------------------

def test_one_rank_is_the_whole_op():
    """n = 1: the op itself (no cp runs), and one causal tile of the whole sequence is priced by the
    whole op's own formula (``compute.node_cost``: FLOPs, efficiency at the keys a query sees)."""
    node = _sdpa(8, 8, 16384)
    whole = node_cost(node, H100)
    t = gather_compute(_shape(8, 8, 16384), (1,), True, H100)
    assert (t.fwd, t.bwd) == pytest.approx((whole.time_fwd, whole.time_bwd), rel=1e-9)
    k = kernel(_shape(8, 8, 16384), Tile(16384, 16384, True, True, True), H100)
    assert (k.fwd, k.bwd) == pytest.approx((whole.time_fwd, whole.time_bwd), rel=1e-9)


@pytest.mark.parametrize("seq,n,heads,kv", [(131072, 16, 8, 8), (32768, 8, 32, 32), (16384, 4, 16, 1),
                                            (8192, 2, 32, 8)])
@pytest.mark.parametrize("zigzag", [True, False])
def test_tiles_cost_at_least_the_balanced_share(seq, n, heads, kv, zigzag):
    """Both forms' slowest rank costs at least what the old model charged (the balanced share times
    the placement's imbalance): the same work, in shorter kernels, plus merges and accumulators."""
    node = _sdpa(heads, kv, seq)
    base = _balanced(node, n)
    old = gather_time(base.time_fwd, base.time_bwd, n, seq, True, 0.0, 0.0, zigzag)
    gather = gather_compute(_shape(heads, kv, seq), (n,), zigzag, H100)
    fwd, bwd, fixed = ring_compute(_shape(heads, kv, seq), (n,), zigzag, H100)
    assert gather.total >= old.compute_fwd + old.compute_bwd
    assert sum(fwd) + sum(bwd) + fixed.total >= old.compute_fwd + old.compute_bwd


def test_non_causal_ring_is_the_even_split_plus_the_merges():
    """Without a mask each ring step is one whole block: the kernels sum to the even split (the same
    FLOPs at the same efficiency: the blocks' keys, 16384, are past the curve's last point like the
    whole op's) with one launch per block, and the rest is the merges, each at least a read and a
    write of its partial output rows and log-sum-exp in fp32."""
    seq, n, heads = 65536, 4, 8
    node = _sdpa(heads, heads, seq, causal=False)
    even = _balanced(node, n)
    shape = _shape(heads, heads, seq, causal=False)
    block = Tile(seq // n, seq // n, False, True, True)
    assert all(block_tiles(seq, n, r, j, False, False) == (block,) for r in range(n) for j in range(n))
    kernels = sum((kernel(shape, block, H100) for _ in range(n)), ZERO)
    launch = H100.kernel_overhead
    assert kernels.fwd == pytest.approx(even.time_fwd + (n - 1) * launch, rel=1e-6)
    assert kernels.bwd == pytest.approx(even.time_bwd + (n - 1) * launch, rel=1e-6)
    fwd, bwd, fixed = ring_compute(shape, (n,), False, H100)
    merges = sum(fwd) + sum(bwd) + fixed.total - kernels.total
    assert merges == pytest.approx(n * around(shape, block, H100).total + per_op(shape, seq // n, seq // n,
                                                                                 [seq // n] * n, H100).total)
    rows = heads * seq // n
    least = n * 2 * rows * (128 + 1) * 4 / (H100.memory_bandwidth * H100.memory_efficiency)
    assert merges > least


# ---- the placements' balance ------------------------------------------------------------------------

@pytest.mark.parametrize("seq,n,heads,kv", [(131072, 16, 8, 8), (65536, 8, 32, 8), (131072, 16, 16, 1)])
def test_zigzag_ranks_get_equal_charges(seq, n, heads, kv):
    """Zig-zag, long sequences: every gather-form rank within 10 % of the others. The last rank,
    whose two chunks are adjacent, runs two tiles instead of four and is the cheapest (as measured in
    RESULTS §GPU6). The ring's ranks do equal kernel work (within 10 %); their merges differ (an
    earlier rank's block is two tiles, a later one's one), and the lock-step charges each step its
    busiest rank."""
    shape = _shape(heads, kv, seq)
    ranks = [gather_rank_time(shape, gather_tiles(seq, n, r, True, True), n, H100).total for r in range(n)]
    assert max(ranks) <= 1.10 * min(ranks)
    assert ranks[-1] == min(ranks)
    work = [sum((kernel(shape, t, H100) for j in range(n) for t in block_tiles(seq, n, r, j, True, True)), ZERO).total
            for r in range(n)]
    assert max(work) <= 1.10 * min(work)


@pytest.mark.parametrize("form", ["attn_gather", "attn_ring"])
def test_contiguous_last_rank_costs_the_most(form):
    """Contiguous pieces under a causal mask: the last rank attends to every key, and costs the most
    (gather: its tiles; ring: its blocks summed over the steps)."""
    seq, n = 32768, 8
    shape = _shape(32, 32, seq)
    if form == "attn_gather":
        ranks = [gather_rank_time(shape, gather_tiles(seq, n, r, False, True), n, H100).total for r in range(n)]
    else:
        ranks = [sum((tiles_time(shape, block_tiles(seq, n, r, j, False, True), H100) for j in range(n)), ZERO).total
                 for r in range(n)]
    assert ranks.index(max(ranks)) == n - 1
    assert ranks == sorted(ranks)


def test_several_cp_axes_are_cut_from_positions():
    """Two cp axes (2 x 2 pieces): each rank's tiles are cut from its positions; one axis of 4 and two
    of 2 hold the same work, so the slowest ranks' kernels agree within the tiles' shapes."""
    seq = 8192
    shape = _shape(8, 8, seq)
    two = gather_compute(shape, (2, 2), True, H100)
    one = gather_compute(shape, (4,), True, H100)
    assert two.total == pytest.approx(one.total, rel=0.25)
    fwd, bwd, fixed = ring_compute(shape, (2, 2), True, H100)
    assert len(fwd) == 2 and min(fwd) > 0 and fixed.total > 0


# ---- in the planner's cost --------------------------------------------------------------------------

def _cp(form, zigzag=True):
    spec = (Shard(2, 2, True),) if zigzag else (Shard(2),)
    return Strategy((spec, spec, spec), spec, (f"{form}:cp",), "cp")


@pytest.mark.parametrize("form", ["attn_gather", "attn_ring"])
def test_cp_time_prices_tiles_where_the_runtime_runs_them(form):
    """bf16 on an H100: the tiles' compute (memoised per shape, axes, order, device). fp32 on an H100
    (no fused kernel: the explicit path), an explicit mask, and the CPU (its tiles measured within
    12 % of the share): the balanced-share model as before."""
    n = 4
    c = Costing((n,), H100)
    node = _sdpa(8, 8, 16384)
    st = _cp(form)
    cost = split_cost(node, node_cost(node, H100), st, list(node.all_input_nodes), c)
    t = cp_time(node, st, cost, c)
    tiles = cp_compute(form, _shape(8, 8, 16384), (n,), True, H100)
    if form == "attn_gather":
        assert (t.compute_fwd, t.compute_bwd) == pytest.approx((tiles.fwd, tiles.bwd))
    else:
        assert t.compute_fwd == pytest.approx(sum(tiles[0]) + tiles[2].fwd)
    assert t.compute_fwd + t.compute_bwd > cost.time_total
    cpu = Costing((n,), get_device("cpu"))
    for other, cc in ((_sdpa(8, 8, 16384, dtype=torch.float32), c), (_sdpa(8, 8, 16384, causal=False, mask=True), c),
                      (_sdpa(8, 8, 16384, dtype=torch.float32), cpu), (node, cpu)):
        cost = split_cost(other, node_cost(other, cc.device), st, list(other.all_input_nodes)[:3], cc)
        t = cp_time(other, st, cost, cc)
        assert t.compute_fwd + t.compute_bwd == pytest.approx(cost.time_total)


def test_pricing_a_wide_axis_is_quick():
    """A 4096-rank axis (AUTO offers cp on any axis) prices in well under a second per form."""
    import time
    shape = _shape(16, 1, 4096 * 16)
    t0 = time.process_time()
    gather_compute(shape, (4096,), True, H100)
    fwd, _, _ = ring_compute(shape, (4096,), True, H100)
    assert time.process_time() - t0 < 5.0 and len(fwd) == 4096      # the O(n^2) count took minutes
    assert math.isfinite(sum(fwd))


def test_a_heads_split_on_another_axis_divides_the_tiles_batch():
    """cp 4 x tp 2 with the heads split on tp: the rank's tiles are those of half the heads, as on a
    cp-only mesh for an op of half the heads (Llama 3's 128K row splits heads on tp 8 beside cp 16)."""
    node, half = _sdpa(16, 8, 16384), _sdpa(8, 4, 16384)
    z = Shard(2, 2, True)
    both = Strategy(((z, Shard(1)),) * 3, (z, Shard(1)), ("attn_gather:cp", None), "cp")
    c2 = Costing((4, 2), H100)
    t2 = cp_time(node, both, split_cost(node, node_cost(node, H100), both, list(node.all_input_nodes), c2), c2)
    c1 = Costing((4,), H100)
    one = _cp("attn_gather")
    t1 = cp_time(half, one, split_cost(half, node_cost(half, H100), one, list(half.all_input_nodes), c1), c1)
    assert (t2.compute_fwd, t2.compute_bwd) == pytest.approx((t1.compute_fwd, t1.compute_bwd))
