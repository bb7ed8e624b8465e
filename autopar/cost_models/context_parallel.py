"""Step time of context-parallel attention (``sharding/rules/attention.py``'s ``"cp"`` strategies).

Pure arithmetic on times the caller has already costed (``solver/cp_costs.py`` feeds it): the
op's per-rank compute when the work divides evenly (``fwd``, ``bwd``: the one-device time over
the ranks that split it) and the seconds of the collectives ``sharding/local_impls.py`` lists.

What the model assumes:

* **Work follows the visible entries.** A causal op's time is spread over its (query, key) pairs
  that the mask leaves visible (a flash kernel skips masked blocks), so with the sequence split
  into ``n`` contiguous pieces the piece holding the last queries does ``(2n-1)/n`` times the
  mean for a long sequence (``rank_shares``, exact counts). The step waits for the slowest rank,
  so that is what is charged. A non-causal op, or one whose mask is an explicit tensor (its
  pattern unknown when planning), divides evenly. In the zig-zag order (``zigzag=True``: rank
  ``r`` holds chunks ``r`` and ``2n-1-r`` of ``2n``, the placement ``Z(dim)``) every rank has the
  same visible pairs, so the imbalance is 1; in the ring each block is then cut at its pieces'
  borders and only the visible tiles run (``sharding/cp_positions.tiles``), half a block per
  step after the first.
* **Gather form** (``attn_gather``): the K/V all-gathers in forward and their gradients'
  reduce-scatters in backward run before / after the op, not overlapped; then the slowest rank's
  share of the work.
* **Ring form** (``attn_ring``): ranks step in lock-step through ``n`` blocks (a step ends when
  every rank has its next block). Forward step ``s``: the block's attention and the next K/V hop
  (``n - 1`` hops) run together, ``max(compute, hop)`` where the device overlaps them
  (accelerators: the transfer runs on its own engine/stream), ``compute + hop`` where it does not
  (``overlap=False``: CPU under gloo, whose transfers share the cores that compute). Backward step
  ``s``: the K/V hop runs beside the block's gradient computation, and the block's gradient
  accumulators (at least fp32) hop after it (``n`` hops, the last brings them home):
  ``max(hop_kv, compute + hop_grad)`` overlapped, ``compute + hop_kv + hop_grad`` not. Blocks the
  causal mask hides entirely are skipped (their step is the hop alone). With several cp axes the
  outer ones are gathered first, as in the gather form, and the ring spreads the slowest rank's
  work evenly over its steps.
* **Fused tiles** (``cost_models/cp_tiles.py``, chosen by ``solver/cp_costs.tiled_shape``): where
  an accelerator runs a form's attention as fused tiles (no mask tensor, no dropout, fp16 / bf16;
  the gather form only under the causal flag) the compute is not the share above but the rank's
  tiles: each tile's kernel at the efficiency of its own keys, its launch, the log-sum-exp merge
  and the fp32 accumulators (``lockstep_time`` takes the ring's busiest rank per step). Elsewhere
  the share above stands: an explicit mask or fp32 on a GPU (the explicit path), and the CPU, whose
  tiles measured within 12 % of the share (``cp_tiles.py``).

Memory (``solver/cp_costs.py``): activations are the sequence shard (the placements divide
them); the gather form saves the gathered K/V of every layer for backward (``n`` shards each),
and in backward holds their whole gradients until the reduce-scatter; the ring saves only its
own shard and holds two blocks (the one it computes on and the one in flight) and, in backward,
two blocks of gradient accumulators.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass


def _entries(q0: int, q1: int, k0: int, k1: int, causal: bool) -> int:
    """Visible (query, key) pairs of queries ``[q0, q1)`` against keys ``[k0, k1)``: all of them,
    or under the top-left causal mask those with key <= query (``_causal_prefix``)."""
    if not causal:
        return (q1 - q0) * (k1 - k0)
    return _causal_prefix(q1, k0, k1) - _causal_prefix(q0, k0, k1)


def _causal_prefix(m: int, k0: int, k1: int) -> int:
    """Visible pairs of queries ``[0, m)`` against keys ``[k0, k1)`` under the causal mask, in closed
    form: query ``i`` sees ``clamp(i + 1 - k0, 0, L)`` keys (``L = k1 - k0``), so the queries
    ``k0 .. k0 + p - 1`` (``p = clamp(m - k0, 0, L)``) add ``1 + ... + p`` and every later one ``L``."""
    span = k1 - k0
    p = min(max(m - k0, 0), span)
    return p * (p + 1) // 2 + span * max(0, m - k0 - span)


def _pieces(r: int, n: int, seq: int, zigzag: bool) -> list[tuple[int, int]]:
    """Rank ``r``'s position ranges: piece ``r`` of ``n``, or chunks ``r`` and ``2n-1-r`` of ``2n``."""
    if not zigzag:
        size = seq // n
        return [(r * size, (r + 1) * size)]
    size = seq // (2 * n)
    return [(c * size, (c + 1) * size) for c in (r, 2 * n - 1 - r)]


@functools.lru_cache(maxsize=256)
def _block_table(n: int, seq: int, causal: bool, zigzag: bool) -> tuple[tuple[float, ...], ...]:
    total = _entries(0, seq, 0, seq, causal)
    pieces = [_pieces(r, n, seq, zigzag) for r in range(n)]
    return tuple(tuple(sum(_entries(q0, q1, k0, k1, causal) for q0, q1 in pieces[r] for k0, k1 in pieces[j]) / total
                       for j in range(n)) for r in range(n))


def block_shares(n: int, seq: int, causal: bool, zigzag: bool = False) -> list[list[float]]:
    """``share[r][j]``: the fraction of the op's visible (query, key) pairs in the block of the
    queries of rank ``r`` against the keys of rank ``j`` (``n`` ranks over ``seq``; contiguous
    pieces, or the zig-zag order). O(n^2) closed-form counts, memoised per (n, seq, mask, order)."""
    return [list(row) for row in _block_table(n, seq, causal, zigzag)]


def ring_steps(n: int, seq: int, causal: bool, zigzag: bool = False) -> list[float]:
    """``M[s]``: the largest share of the op's visible pairs any rank computes at ring step ``s``
    (its queries against the keys of rank ``(r - s) mod n``, ``block_shares``), what a lock-step ring
    waits for. When the pieces are equal chunks of ``c`` positions (``seq`` divisible by ``n``, or by
    ``2n`` in the zig-zag order) a chunk sees an earlier chunk whole (``c^2`` pairs), itself as a
    triangle (``c(c+1)/2``) and a later one not at all under the causal mask, so in closed form

    * not causal: every block ``(seq/n)^2``;
    * contiguous: step 0 the diagonal triangle, every later step some rank's whole earlier block;
    * zig-zag (rank ``r`` holds chunks ``r`` and ``2n-1-r``): step 0 two triangles and the second
      chunk's whole view of the first, every later step two whole chunks (``j < r``: chunk ``r`` and
      chunk ``2n-1-r`` see chunk ``j``; ``j > r``: chunk ``2n-1-r`` sees both of ``j``'s).

    Otherwise the maxima of ``block_shares``' columns (O(n^2))."""
    total = _entries(0, seq, 0, seq, causal)
    chunks = 2 * n if zigzag else n
    if n > 1 and seq % chunks == 0:
        c = seq // chunks
        full, tri = c * c, c * (c + 1) // 2
        if not causal:
            first = later = (seq // n) ** 2
        elif zigzag:
            first, later = full + 2 * tri, 2 * full
        else:
            first, later = tri, full
        return [first / total] + [later / total] * (n - 1)
    share = _block_table(n, seq, causal, zigzag)
    return [max(share[r][(r - s) % n] for r in range(n)) for s in range(n)]


@functools.lru_cache(maxsize=256)
def _rank_table(n: int, seq: int, causal: bool, zigzag: bool) -> tuple[float, ...]:
    total = _entries(0, seq, 0, seq, causal)
    keys = (2 * n) * (seq // (2 * n)) if zigzag else n * (seq // n)     # the positions the pieces cover
    return tuple(sum(_entries(q0, q1, 0, keys, causal) for q0, q1 in _pieces(r, n, seq, zigzag)) / total
                 for r in range(n))


def rank_shares(n: int, seq: int, causal: bool, zigzag: bool = False) -> list[float]:
    """Each rank's fraction of the op's work (its queries' row of ``block_shares``: its pieces'
    queries against every key the pieces hold, O(n))."""
    return list(_rank_table(n, seq, causal, zigzag))


def imbalance(n: int, seq: int, causal: bool, zigzag: bool = False) -> float:
    """The slowest rank's work over the mean (1 when it divides evenly)."""
    return n * max(rank_shares(n, seq, causal, zigzag)) if n > 1 else 1.0


@dataclass(frozen=True)
class CpTime:
    """The slowest rank's seconds of one context-parallel attention op: compute (forward,
    backward) and the communication it does not hide (forward, backward)."""

    compute_fwd: float
    compute_bwd: float
    comm_fwd: float
    comm_bwd: float

    @property
    def fwd(self) -> float:
        return self.compute_fwd + self.comm_fwd

    @property
    def total(self) -> float:
        return self.fwd + self.compute_bwd + self.comm_bwd


def gather_time(fwd: float, bwd: float, n: int, seq: int, causal: bool, gathers: float, scatters: float,
                zigzag: bool = False) -> CpTime:
    """The gather form: ``gathers`` (seconds of the forward K/V all-gathers), ``scatters``
    (backward reduce-scatters), the work at the slowest rank's share."""
    f = imbalance(n, seq, causal, zigzag)
    return CpTime(fwd * f, bwd * f, gathers, scatters)


def ring_time(fwd: float, bwd: float, n: int, seq: int, causal: bool, hop_kv: float, hop_grad: float,
              overlap: bool, outer: int = 1, gathers: float = 0.0, scatters: float = 0.0,
              zigzag: bool = False) -> CpTime:
    """The ring form over ``n`` ranks (module docstring): ``hop_kv``, ``hop_grad`` the seconds of
    one hop of the K/V block and of its gradient accumulators (0 when nothing needs a gradient);
    ``outer`` the product of the further cp axes gathered first (``gathers``, ``scatters``);
    ``zigzag`` the sequence in the zig-zag order."""
    pieces = n * outer
    if outer > 1:           # blocks hold keys of several pieces: the slowest rank's work, spread evenly
        widest = [imbalance(pieces, seq, causal, zigzag) / n] * n
    else:                   # each step waits for its busiest rank (``ring_steps``)
        widest = [n * m for m in ring_steps(n, seq, causal, zigzag)]
    t_f = t_b = c_f = c_b = 0.0
    for s in range(n):
        w = widest[s]
        kv = hop_kv if s < n - 1 else 0.0
        cf, cb = fwd * w, bwd * w
        c_f, c_b = c_f + cf, c_b + cb
        if overlap:
            t_f += max(cf, kv)
            t_b += max(kv, cb + hop_grad) if bwd or hop_grad else 0.0
        else:
            t_f += cf + kv
            t_b += cb + kv + hop_grad if bwd or hop_grad else 0.0
    return CpTime(c_f, c_b, t_f - c_f + gathers, t_b - c_b + scatters)


def lockstep_time(widest_fwd: list[float], widest_bwd: list[float], hop_kv: float, hop_grad: float,
                  overlap: bool, fixed_fwd: float = 0.0, fixed_bwd: float = 0.0, gathers: float = 0.0,
                  scatters: float = 0.0) -> CpTime:
    """The ring's lock-step (module docstring) given the busiest rank's compute at each of the ``n``
    steps (``widest_fwd[s]``, ``widest_bwd[s]`` seconds; hops after all but the last step) and the
    once-per-op compute before and after the steps (``fixed_fwd``, ``fixed_bwd``): a step lasts
    its busiest rank's compute, or the hop where that is longer and overlapped."""
    n = len(widest_fwd)
    has_bwd = any(widest_bwd) or hop_grad > 0
    t_f = t_b = 0.0
    for s in range(n):
        kv = hop_kv if s < n - 1 else 0.0
        cf, cb = widest_fwd[s], widest_bwd[s]
        if overlap:
            t_f += max(cf, kv)
            t_b += max(kv, cb + hop_grad) if has_bwd else 0.0
        else:
            t_f += cf + kv
            t_b += cb + kv + hop_grad if has_bwd else 0.0
    c_f, c_b = sum(widest_fwd), sum(widest_bwd)
    return CpTime(c_f + fixed_fwd, c_b + fixed_bwd, t_f - c_f + gathers, t_b - c_b + scatters)
