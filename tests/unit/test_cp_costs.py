"""The cost model of context-parallel attention (``cost_models/context_parallel.py``,
``solver/cp_costs.py``), checked against formulas written here from first principles."""
from __future__ import annotations

import math

import pytest
import torch
import torch.fx as fx
from torch.ops import aten

from autopar.collectives.attention_cp import causal_flops_per_rank
from autopar.cost_models.compute import node_cost
from autopar.cost_models.context_parallel import block_shares, gather_time, imbalance, rank_shares, ring_time
from autopar.cost_models.devices import get_device
from autopar.sharding.placements import R, Shard
from autopar.sharding.strategy import Strategy
from autopar.solver.cp_costs import cp_saved_bytes, cp_time, cp_transient_bytes
from autopar.solver.strategy_prices import Costing, split_cost


# ---- the balance of a contiguous causal split -------------------------------------------------

@pytest.mark.parametrize("n,seq", [(2, 8), (4, 16), (4, 64), (8, 64)])
def test_causal_rank_shares_count_visible_pairs(n, seq):
    """Rank r holds queries [r s, (r+1) s), s = seq / n; query i sees keys 0..i: i + 1 pairs."""
    s = seq // n
    total = seq * (seq + 1) / 2
    expect = [(s * (r * s) + s * (s + 1) / 2) / total for r in range(n)]
    assert rank_shares(n, seq, True) == pytest.approx(expect)
    flops = causal_flops_per_rank(seq, [[r] for r in range(n)], n)     # the runtime module's own count
    assert rank_shares(n, seq, True) == pytest.approx([f / sum(flops) for f in flops])
    assert rank_shares(n, seq, False) == pytest.approx([1 / n] * n)
    assert sum(map(sum, block_shares(n, seq, True))) == pytest.approx(1.0)


def test_causal_imbalance_is_the_last_ranks_share():
    """The slowest (last) rank over the mean: (2n - 1) / n for a long sequence; 1 without a mask."""
    for n in (2, 4, 8):
        assert imbalance(n, 4096 * n, True) == pytest.approx((2 * n - 1) / n, rel=1e-3)
        assert imbalance(n, 4096, False) == pytest.approx(1.0)
    assert imbalance(1, 64, True) == 1.0


# ---- gather and ring forms as formulas --------------------------------------------------------

def test_gather_form_is_the_slowest_rank_plus_its_collectives():
    fwd, bwd, ag, rs = 1.0, 2.0, 0.3, 0.4
    t = gather_time(fwd, bwd, 4, 64, True, ag, rs)
    f = 4 * rank_shares(4, 64, True)[-1]
    assert t.total == pytest.approx((fwd + bwd) * f + ag + rs)
    assert gather_time(fwd, bwd, 4, 64, False, ag, rs).total == pytest.approx(fwd + bwd + ag + rs)


@pytest.mark.parametrize("hop", [0.01, 1.0])
def test_ring_without_mask(hop):
    """Non-causal, n blocks of fwd / n each. Overlapped: n - 1 steps of max(block, hop) and the last
    block; backward n - 1 steps of max(hop, block + grad hop) and the last block + grad hop.
    Not overlapped (CPU): everything adds up."""
    n, fwd, bwd, g = 4, 1.0, 2.0, 0.05
    t = ring_time(fwd, bwd, n, 64, False, hop, g, overlap=True)
    f_expect = (n - 1) * max(fwd / n, hop) + fwd / n
    b_expect = (n - 1) * max(hop, bwd / n + g) + bwd / n + g
    assert t.fwd == pytest.approx(f_expect)
    assert t.total == pytest.approx(f_expect + b_expect)
    assert t.compute_fwd == pytest.approx(fwd) and t.compute_bwd == pytest.approx(bwd)
    serial = ring_time(fwd, bwd, n, 64, False, hop, g, overlap=False)
    assert serial.total == pytest.approx(fwd + bwd + 2 * (n - 1) * hop + n * g)
    assert t.total <= serial.total


def test_causal_ring_steps_wait_for_the_busiest_rank():
    """Causal, lock-step: step 0 every rank computes its diagonal block (s (s+1) / 2 pairs); at
    step k >= 1 the ranks r >= k compute a full block (s^2 pairs), the others skip it. Its compute
    is then the gather form's slowest rank's."""
    n, seq, fwd = 4, 64, 1.0
    s, total = seq // n, seq * (seq + 1) / 2
    diag, full = n * fwd * s * (s + 1) / 2 / total, n * fwd * s * s / total
    t = ring_time(fwd, 0.0, n, seq, True, 0.0, 0.0, overlap=True)
    assert t.compute_fwd == pytest.approx(diag + (n - 1) * full)
    assert t.compute_fwd == pytest.approx(gather_time(fwd, 0.0, n, seq, True, 0.0, 0.0).compute_fwd)
    hop = 10 * full                 # the hops dominate: every step but the last is a hop
    assert ring_time(fwd, 0.0, n, seq, True, hop, 0.0, overlap=True).fwd == pytest.approx((n - 1) * hop + full)


# ---- on a traced attention node: ring vs gather at few and many K/V heads ----------------------

def _sdpa(batch, heads, kv_heads, seq, dim, causal=True):
    g = fx.Graph()
    shapes = [(batch, heads, seq, dim), (batch, kv_heads, seq, dim), (batch, kv_heads, seq, dim)]
    ins = []
    for name, shape in zip("qkv", shapes):
        p = g.placeholder(name)
        p.meta["val"] = torch.empty(shape, device="meta", requires_grad=True)
        ins.append(p)
    node = g.call_function(aten.scaled_dot_product_attention.default, tuple(ins),
                           {"is_causal": causal, "enable_gqa": kv_heads != heads})
    node.meta["val"] = torch.empty(shapes[0], device="meta")
    g.output(node)
    return node


def _cp(form: str, n: int = 4) -> Strategy:
    spec = (Shard(2),)
    return Strategy((spec, spec, spec), spec, (f"{form}:cp",), "cp")


def _times(node, device, n=4):
    c = Costing((n,), device)
    cost = split_cost(node, node_cost(node, device), _cp("attn_gather"), [a for a in node.all_input_nodes], c)
    return {form: cp_time(node, _cp(form), cost, c) for form in ("attn_gather", "attn_ring")}, c


def test_ring_hides_kv_hops_on_an_accelerator_gather_does_not():
    """H100: many K/V heads (32): the K/V hops hide under the blocks' attention in the ring, the
    all-gather / reduce-scatter of the gather form add up: the ring is faster. With few K/V heads (2)
    the K/V are 16x smaller: the two forms nearly agree."""
    h100 = get_device("h100")
    many, c = _times(_sdpa(1, 32, 32, 16384, 128), h100)
    few, _ = _times(_sdpa(1, 32, 2, 16384, 128), h100)
    assert many["attn_ring"].compute_fwd == pytest.approx(many["attn_gather"].compute_fwd)
    assert many["attn_ring"].total < many["attn_gather"].total
    gap = lambda t: (t["attn_gather"].total - t["attn_ring"].total) / t["attn_gather"].total  # noqa: E731
    assert 0 <= gap(few) < gap(many)
    # the gather form's exposed communication is its collectives' time
    node = _sdpa(1, 32, 32, 16384, 128)
    kv = 2 * 32 * 16384 * 128 * 4 / 4          # K and V shards, fp32
    ag = 2 * c.comm("all_gather", kv / 2 * 4, 0)
    assert many["attn_gather"].comm_fwd == pytest.approx(ag)
    # memory: the gather form saves the gathered K/V (3 more shards); the ring only its own
    assert cp_saved_bytes(node, _cp("attn_gather"), c) == pytest.approx(3 * kv)
    assert cp_saved_bytes(node, _cp("attn_ring"), c) == 0
    whole = [(1, kv * 4 / 2), (2, kv * 4 / 2)]
    assert cp_transient_bytes(_cp("attn_gather"), c, whole) == pytest.approx(4 * kv)
    assert cp_transient_bytes(_cp("attn_ring"), c, whole) == pytest.approx(4 * kv)


def test_on_cpu_nothing_overlaps():
    """The CPU preset (gloo): the ring's hops add to its compute."""
    cpu = get_device("cpu")
    t, c = _times(_sdpa(1, 4, 4, 1024, 8), cpu)
    ring = t["attn_ring"]
    hop = 2 * c.comm("send_recv", 1024 // 4 * 4 * 8 * 4, 0)
    assert ring.comm_fwd == pytest.approx(3 * hop)
    assert math.isclose(ring.compute_fwd + ring.comm_fwd, ring.fwd)


def test_replicated_input_is_not_cp():
    c = Costing((4,), get_device("cpu"))
    node = _sdpa(1, 4, 4, 64, 8)
    st = Strategy(((R,), (R,), (R,)), (R,), (None,), "replicate")
    assert cp_saved_bytes(node, st, c) == 0 and cp_transient_bytes(st, c, [(1, 1.0)]) == 0


# ---- closed forms against counts made position by position -----------------------------------

def _pairs(q0, q1, k0, k1, causal):
    """Visible (query, key) pairs counted one query at a time."""
    return sum(max(0, min(k1, i + 1) - k0) if causal else k1 - k0 for i in range(q0, q1))


@pytest.mark.parametrize("causal", [True, False])
def test_entries_closed_form_counts_every_range(causal):
    from autopar.cost_models.context_parallel import _entries
    for q0 in range(0, 12, 3):
        for q1 in range(q0, 14, 2):
            for k0 in range(0, 12, 2):
                for k1 in range(k0, 15, 3):
                    assert _entries(q0, q1, k0, k1, causal) == _pairs(q0, q1, k0, k1, causal), (q0, q1, k0, k1)


@pytest.mark.parametrize("n,seq", [(2, 8), (3, 12), (4, 16), (4, 18), (5, 40), (8, 64), (8, 70)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("zigzag", [True, False])
def test_ring_steps_are_the_busiest_rank_of_each_step(n, seq, causal, zigzag):
    """``ring_steps`` (closed form where the pieces are equal chunks) = the largest block any rank
    computes at each step, counted pair by pair; the rank shares sum its rows."""
    from autopar.cost_models.context_parallel import _pieces, ring_steps
    total = _pairs(0, seq, 0, seq, causal)
    pieces = [_pieces(r, n, seq, zigzag) for r in range(n)]
    block = [[sum(_pairs(a, b, c, d, causal) for a, b in pieces[r] for c, d in pieces[j]) / total
              for j in range(n)] for r in range(n)]
    assert ring_steps(n, seq, causal, zigzag) == pytest.approx([max(block[r][(r - s) % n] for r in range(n))
                                                               for s in range(n)])
    assert rank_shares(n, seq, causal, zigzag) == pytest.approx([sum(row) for row in block])


def test_ring_costs_of_a_wide_axis_are_quick():
    """A ring over thousands of ranks (AUTO offers cp on any axis of a large mesh) costs in closed form."""
    import time
    t0 = time.process_time()
    t = ring_time(1.0, 2.0, 4096, 8192, True, 1e-4, 1e-4, True, zigzag=True)
    assert time.process_time() - t0 < 5.0       # the O(n^2) count took minutes here
    # zig-zag chunks of one position: step 0 sees 1 + 2 x 1 pairs, every later step 2; x n ranks' even split
    assert t.compute_fwd == pytest.approx(4096 * (3 + 2 * 4095) / (8192 * 8193 / 2))


def test_a_recomputed_gather_form_keeps_no_gathered_kv():
    """Under recomputation the attention node saves nothing (its region re-runs it in backward): its memory
    is not the gathered K/V the gather form saves when it runs once (``strategy_prices.node_costs``)."""
    from autopar.solver.strategy_prices import node_costs
    node = _sdpa(1, 32, 32, 16384, 128)
    c = Costing((4,), get_device("h100"))
    kept = node_costs(node, [_cp("attn_gather")], c, {}, set(), recomputed=False)[1][0]
    again = node_costs(node, [_cp("attn_gather")], c, {}, set(), recomputed=True)[1][0]
    assert kept == pytest.approx(cp_saved_bytes(node, _cp("attn_gather"), c)) and kept > 0
    assert again == 0
