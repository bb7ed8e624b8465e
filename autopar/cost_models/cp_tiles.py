"""One context-parallel rank's attention compute as the runtime runs it on fused tiles.

Where ``collectives/fused_blocks.py`` has a fused kernel (the CPU's flash kernel in any dtype; CUDA in
fp16 / bf16 with a head dim that is a multiple of 8 up to 256), ``collectives/attention_cp.py`` runs a
rank's attention (the gather form's causal ``_TiledAttention``; every ring block) as *tiles*: the
wholly visible ``(query run, key range)`` pairs and the causal squares on the diagonal that
``sharding/cp_positions.tiles`` cuts from the rank's positions. Per tile, with ``B`` the query's
batch x heads, ``r`` its rows, ``k`` its keys, ``e`` the element bytes and ``a`` the accumulation's
(fp32, or the dtype's if wider):

    entries  = r k (full tile)  or  r (r + 1) / 2 (causal square)
    kernel   = roofline(2 B entries (d + dv) FLOPs, B e (r + k) (d + dv) + 4 B r bytes, 1 kernel)
               at attention_eff(entries / r)                 backward: 2x the FLOPs and the bytes

(the whole op's own formula, ``compute.node_cost``, at the tile's keys a query sees), plus memory-bound
traffic at ``memory_bandwidth * memory_efficiency`` and one ``kernel_overhead`` per elementwise kernel:

* forward, per tile: the tile's q rows (``2 B r d e``) and K/V rows (``2 B k (d + dv) e``) copied out
  when they are not the whole tensor; the log-sum-exp merge of the tile's output into the fp32
  running output: per output element the running rows copied out (``2a``, when not whole), the
  tile's output widened (``e + a``, when ``e < a``), both scaled, added and written back (``9a``),
  per row ``_LSE_BYTES * a`` for the log-sum-exp (logaddexp, the infinity guard, two exps, the put);
* backward, per tile: the copies again, plus the output gradient's and saved output's rows
  (``2 B r dv e`` each) and the log-sum-exp's; the tile's ``dq``, ``dk``, ``dv`` added into the
  fp32 accumulators (``2a + e`` per element; grouped-query K/V gradients summed over their heads first);
* per op: the output and log-sum-exp started (zeros) and the output cast back (forward); the
  ``delta = sum(g * out)`` rows, the accumulators zeroed and cast back (backward); where K/V have
  fewer heads, each block's K/V repeated to the query heads (forward and backward). The gather form's
  K/V accumulators are the gathered length, the ring's its block's.

Everything times ``device.compute_scale``. The CPU runs the same tiles (the flash kernel for the CPU,
any dtype) but keeps the balanced share: there a zig-zag rank's tiles measured 0.88-1.12x of the
whole op's time over the ranks (this 2-core VM, one thread, 1K-8K tokens, two runs: bench/RESULTS.md
§35w; the CPU kernel's rate does not fall with shorter keys and its merges are small beside its
attention), while these formulas, with the CPU preset's 20 us per kernel, charged 1.07-1.95x it.

Which tiles: on one cp axis in closed form (``gather_tiles``, ``block_tiles``; tests check them
against the runtime's cut), so a ring step's distinct blocks are three ranks' and pricing is O(n);
a gather axis wider than ``MAX_EXACT_RANKS`` prices its end ranks and a spread between them. On
several cp axes (at most ``MAX_CUT_PIECES`` pieces, ``tiled``) each rank's tiles are cut from its
positions (``cut_gather_tiles``, ``cut_block_tiles``, at two positions per chunk, then multiplied
out: the cut falls on chunk borders), every ring of the outer axes alike; beyond that the caller
keeps the balanced-share model (``solver/cp_costs.tiled_shape``).

What is not priced: kernels that wait on the CPU's launches beyond ``kernel_overhead`` each, and a
cuDNN / flash kernel's own efficiency on a tile whose rows and keys differ much (the curve is read by
the keys a query sees, as for the whole op; §GPU6's measured tiles agree within 10 % at 32K-128K).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from itertools import product

import torch

from autopar.sharding.cp_positions import held, tiles

from .compute import roofline_time

_LSE_BYTES = 22           # accumulator-sized reads and writes per log-sum-exp row of one merge
_MERGE_KERNELS = 13       # logaddexp, isinf, zeros, where, 2 x (sub, exp), 2 muls, add, 2 puts
MAX_CUT_PIECES = 16       # several cp axes: priced as tiles up to this many pieces (``tiled``)
MAX_EXACT_RANKS = 256     # a wider gather axis prices the ranks at its ends and a spread between them


@dataclass(frozen=True)
class AttnShape:
    """What the tiles' cost reads of one attention op."""

    batch: int          # the query's leading dims (batch x heads)
    kv_batch: int       # the keys' leading dims (batch x K/V heads)
    seq: int            # the whole sequence (queries and keys alike)
    d: int              # query / key head dim
    dv: int             # value head dim
    dtype: torch.dtype
    grads: bool         # a backward runs
    causal: bool

    @property
    def elem(self) -> int:
        return self.dtype.itemsize

    @property
    def acc(self) -> int:
        return torch.promote_types(self.dtype, torch.float32).itemsize


@dataclass(frozen=True)
class Tile:
    """One fused call: ``rows`` queries against ``keys`` keys, the causal square or wholly visible;
    ``whole_q`` / ``whole_k``: its queries / keys are the whole tensor (no copy cuts them out)."""

    rows: int
    keys: int
    causal: bool
    whole_q: bool
    whole_k: bool

    @property
    def entries(self) -> int:
        return self.rows * (self.rows + 1) // 2 if self.causal else self.rows * self.keys


@dataclass(frozen=True)
class Seconds:
    """Forward and backward seconds."""

    fwd: float
    bwd: float

    def __add__(self, other: "Seconds") -> "Seconds":
        return Seconds(self.fwd + other.fwd, self.bwd + other.bwd)

    @property
    def total(self) -> float:
        return self.fwd + self.bwd


ZERO = Seconds(0.0, 0.0)


def prices_tiles(device, dtype: torch.dtype, d: int) -> bool:
    """Whether this model prices the op's cp tiles on ``device``: an accelerator running them on its
    fused kernel (``fused_blocks.backend``: fp16 / bf16, a head dim that is a multiple of 8 up to
    256). The CPU runs the same tiles (its flash kernel, any dtype) but keeps the balanced share
    (module docstring)."""
    if getattr(device, "name", "cpu") == "cpu" or getattr(device, "cores", None):
        return False
    return dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256


# ---- the tiles ------------------------------------------------------------------------------------

def _units(seq: int, sizes: tuple[int, ...], zigzag: bool) -> int:
    """Positions at the scale of two per chunk (one would make a causal square a single visible
    entry), or ``seq`` itself where the chunks do not divide it."""
    units = 2 * math.prod(sizes) * (2 ** len(sizes) if zigzag else 1)
    return units if seq % units == 0 else seq


def _cut(qpos: torch.Tensor, kpos: torch.Tensor, causal: bool, scale: int) -> tuple[Tile, ...]:
    return tuple(Tile((qs.stop - qs.start) * scale, (ks.stop - ks.start) * scale, kind == "causal",
                      qs.stop - qs.start == len(qpos), ks.stop - ks.start == len(kpos))
                 for qs, ks, kind in tiles(qpos, kpos, causal))


@lru_cache(maxsize=4096)
def cut_gather_tiles(seq: int, sizes: tuple[int, ...], coords: tuple[int, ...], zigzag: bool,
                     causal: bool) -> tuple[Tile, ...]:
    """The tiles of the gather form's rank at ``coords`` (cp axes of ``sizes``), cut from its
    positions by ``cp_positions.tiles``: its queries against the keys gathered over every axis."""
    units = _units(seq, sizes, zigzag)
    everything = tuple(reversed(range(len(sizes))))
    q = held(units, list(sizes), list(coords), zigzag)
    k = held(units, list(sizes), list(coords), zigzag, everything)
    return _cut(q, k, causal, seq // units)


@lru_cache(maxsize=4096)
def cut_block_tiles(seq: int, sizes: tuple[int, ...], coords: tuple[int, ...], src: int, zigzag: bool,
                    causal: bool) -> tuple[Tile, ...]:
    """The tiles of the ring's rank at ``coords`` against the block of ring rank ``src`` (the last
    axis; the keys gathered over the others), cut by ``cp_positions.tiles``."""
    units = _units(seq, sizes, zigzag)
    outer = tuple(reversed(range(len(sizes) - 1)))
    q = held(units, list(sizes), list(coords), zigzag)
    k = held(units, list(sizes), list(coords[:-1]) + [src], zigzag, outer)
    return _cut(q, k, causal, seq // units)


def _chunk(seq: int, chunks: int) -> int:
    """The length of one of ``chunks`` equal chunks of ``seq`` positions."""
    if seq % chunks:
        raise ValueError(f"cp_tiles: a sequence of {seq} positions does not split into {chunks} equal chunks "
                         f"(a cp axis of n ranks needs a multiple of n, of 2n in the zig-zag order): pick a "
                         f"sequence length or a cp size that divides it")
    return seq // chunks


def gather_tiles(seq: int, n: int, r: int, zigzag: bool, causal: bool) -> tuple[Tile, ...]:
    """The gather form's tiles of rank ``r`` of one cp axis of ``n`` (what ``cut_gather_tiles``
    cuts, in closed form). Contiguous pieces of ``L``: the keys before the piece (``r L``) and its
    causal square. Zig-zag chunks of ``c`` (``r``, ``2n-1-r``): each chunk's keys before it and its
    square; rank ``n-1``'s two chunks are adjacent, one run of ``2c``."""
    if n == 1:
        return (Tile(seq, seq, causal, True, True),)
    if not zigzag:
        size = _chunk(seq, n)
        return ((Tile(size, r * size, False, True, False),) if r else ()) + (Tile(size, size, True, True, False),)
    c = _chunk(seq, 2 * n)
    if r == n - 1:
        return Tile(2 * c, (n - 1) * c, False, True, False), Tile(2 * c, 2 * c, True, True, False)
    head = (Tile(c, r * c, False, False, False),) if r else ()
    return head + (Tile(c, c, True, False, False), Tile(c, (2 * n - 1 - r) * c, False, False, False),
                   Tile(c, c, True, False, False))


def block_tiles(seq: int, n: int, r: int, j: int, zigzag: bool, causal: bool) -> tuple[Tile, ...]:
    """The tiles of ring rank ``r``'s queries against rank ``j``'s block on one cp axis of ``n``
    (what ``cut_block_tiles`` cuts, in closed form). Without a mask one whole block. Contiguous:
    an earlier block whole, the own block's causal square, a later block nothing. Zig-zag (chunks
    ``r``, ``2n-1-r`` of ``c``): the own block two squares and the tail's view of the head (rank
    ``n-1``: one square of ``2c``); an earlier rank's head chunk seen by both chunks (rank ``n-1``:
    by its one run); a later rank's both chunks seen by the tail."""
    size = _chunk(seq, n)
    if not causal:
        return (Tile(size, size, False, True, True),)
    if not zigzag:
        if j > r:
            return ()
        return (Tile(size, size, j == r, True, True),)
    c = _chunk(seq, 2 * n)
    if j == r:
        if r == n - 1:
            return (Tile(2 * c, 2 * c, True, True, True),)
        return Tile(c, c, True, False, False), Tile(c, c, False, False, False), Tile(c, c, True, False, False)
    if j < r:
        if r == n - 1:
            return (Tile(2 * c, c, False, True, False),)
        return Tile(c, c, False, False, False), Tile(c, c, False, False, False)
    return (Tile(c, 2 * c, False, False, True),)


# ---- their seconds --------------------------------------------------------------------------------

def _stream(nbytes: float, kernels: int, device) -> float:
    """Memory-bound elementwise work: ``bytes / (bw * mem_eff) + kernels * kernel_overhead``."""
    return roofline_time(0.0, nbytes, kernels, device, torch.float32)


def kernel(shape: AttnShape, t: Tile, device) -> Seconds:
    """The fused kernel of one tile, forward and backward (module docstring)."""
    flops = 2.0 * shape.batch * t.entries * (shape.d + shape.dv)
    moved = float(shape.batch * (shape.elem * (t.rows + t.keys) * (shape.d + shape.dv) + 4 * t.rows))
    eff = device.attention_eff(t.entries / t.rows)
    fwd = roofline_time(flops, moved, 1, device, shape.dtype, efficiency=eff)
    bwd = roofline_time(2 * flops, 2 * moved, 1, device, shape.dtype, efficiency=eff) if shape.grads else 0.0
    return Seconds(fwd, bwd)


def around(shape: AttnShape, t: Tile, device) -> Seconds:
    """The copies, the merge and the accumulator adds around one tile's kernel (module docstring)."""
    b, e, a, d, dv = shape.batch, shape.elem, shape.acc, shape.d, shape.dv
    widen = e + a if e < a else 0
    copies, kernels = 0.0, 0
    if not t.whole_q:
        copies, kernels = copies + 2 * b * t.rows * d * e, kernels + 1
    if not t.whole_k:
        copies, kernels = copies + 2 * b * t.keys * (d + dv) * e, kernels + 2
    out = b * t.rows * dv * ((0 if t.whole_q else 2 * a) + widen + 9 * a) + b * t.rows * _LSE_BYTES * a
    fwd = _stream(copies + out, kernels + _MERGE_KERNELS + (0 if t.whole_q else 2) + (1 if widen else 0), device)
    if not shape.grads:
        return Seconds(fwd, 0.0)
    rows = 0 if t.whole_q else b * t.rows * (2 * dv * e + 2 * dv * e + 2 * a)       # g, out, lse rows
    adds = (b * t.rows * d + shape.kv_batch * t.keys * (d + dv)) * (2 * a + e)
    fold = (b + shape.kv_batch) * t.keys * (d + dv) * e if shape.kv_batch != b else 0
    bwd = _stream(copies + rows + adds + fold, kernels + (0 if t.whole_q else 3) + 3 + (2 if fold else 0), device)
    return Seconds(fwd, bwd)


def per_op(shape: AttnShape, q_rows: int, acc_keys: int, blocks: list[int], device) -> Seconds:
    """What a rank's op does once: start and cast back the output (forward); ``delta``, the
    accumulators (``q_rows`` queries, ``acc_keys`` keys) zeroed and cast back (backward); the K/V of
    each block (``blocks``: their key counts) repeated to the query heads where grouped."""
    b, kb, e, a, d, dv = shape.batch, shape.kv_batch, shape.elem, shape.acc, shape.d, shape.dv
    widen = e + a if e < a else 0
    expand = sum((kb + b) * k * (d + dv) * e for k in blocks) if kb != b else 0
    expand_kernels = 2 * len(blocks) if kb != b else 0
    fwd = _stream(b * q_rows * (dv * a + a + dv * widen) + expand, 2 + (1 if widen else 0) + expand_kernels, device)
    if not shape.grads:
        return Seconds(fwd, 0.0)
    delta = b * q_rows * dv * (2 * widen + 4 * a)
    accs = (b * q_rows * d + kb * acc_keys * (d + dv)) * (a + widen)
    bwd = _stream(delta + accs + expand, (4 if widen else 2) + (6 if widen else 3) + expand_kernels, device)
    return Seconds(fwd, bwd)


def tiles_time(shape: AttnShape, tile_list, device) -> Seconds:
    """Kernels and their surroundings of ``tile_list``, times ``device.compute_scale``."""
    total = ZERO
    for t in tile_list:
        total = total + kernel(shape, t, device) + around(shape, t, device)
    return _scaled(total, device)


def _scaled(s: Seconds, device) -> Seconds:
    k = device.compute_scale
    return Seconds(s.fwd * k, s.bwd * k)


def tiled(sizes: tuple[int, ...]) -> bool:
    """Whether ``cp_compute`` prices this many cp axes as tiles: one axis (closed forms), or several
    with at most ``MAX_CUT_PIECES`` pieces (each rank's tiles cut from its positions)."""
    return len(sizes) == 1 or math.prod(sizes) <= MAX_CUT_PIECES


def _ranks(n: int) -> list[int]:
    """The gather form's ranks whose tiles are priced: all, or on a wide axis the first and last
    ``MAX_EXACT_RANKS // 4`` and ``MAX_EXACT_RANKS // 2`` spread between (a rank's tiles change with
    its index only through the lengths of its two full tiles)."""
    if n <= MAX_EXACT_RANKS:
        return list(range(n))
    q = MAX_EXACT_RANKS // 4
    return sorted(set(range(q)) | set(range(n - q, n)) | {round(i * (n - 1) / (2 * q)) for i in range(2 * q + 1)})


def gather_compute(shape: AttnShape, sizes: tuple[int, ...], zigzag: bool, device) -> Seconds:
    """The slowest rank's compute under the gather form (``sizes``: the cp axes; ``tiled(sizes)``)."""
    pieces = math.prod(sizes)
    if pieces == 1:                       # no cp: the op itself, one call
        return _scaled(kernel(shape, Tile(shape.seq, shape.seq, shape.causal, True, True), device), device)
    if len(sizes) == 1:
        rank_tiles = [gather_tiles(shape.seq, pieces, r, zigzag, shape.causal) for r in _ranks(pieces)]
    else:
        rank_tiles = [cut_gather_tiles(shape.seq, sizes, coords, zigzag, shape.causal)
                      for coords in product(*(range(n) for n in sizes))]
    return max((gather_rank_time(shape, ts, pieces, device) for ts in set(rank_tiles)), key=lambda t: t.total)


def gather_rank_time(shape: AttnShape, rank_tiles, pieces: int, device) -> Seconds:
    """One gather-form rank's compute: its tiles and the once-per-op work (its ``seq / pieces``
    queries, the gathered keys' accumulators)."""
    fixed = per_op(shape, shape.seq // pieces, shape.seq, [shape.seq], device)
    return tiles_time(shape, rank_tiles, device) + _scaled(fixed, device)


def ring_compute(shape: AttnShape, sizes: tuple[int, ...], zigzag: bool,
                 device) -> tuple[list[float], list[float], Seconds]:
    """The ring form (``sizes``: the cp axes, the ring on the last; ``tiled(sizes)``): per step the
    busiest rank's forward and backward compute (every ring of the outer axes alike), and the
    once-per-op work. On one axis each step's distinct blocks are those of three ranks: ``n-1``,
    ``s`` (earlier blocks) and ``0`` (a later block; at step 0 the own one)."""
    n, pieces = sizes[-1], math.prod(sizes)
    block = shape.seq // n
    if len(sizes) == 1:
        steps = [{block_tiles(shape.seq, n, r, (r - s) % n, zigzag, shape.causal) for r in {0, min(s, n - 1), n - 1}}
                 for s in range(n)]
    else:
        steps = [{cut_block_tiles(shape.seq, sizes, outer + (r,), (r - s) % n, zigzag, shape.causal)
                  for outer in product(*(range(m) for m in sizes[:-1])) for r in range(n)} for s in range(n)]
    memo: dict = {}

    def cost(ts):
        if ts not in memo:
            memo[ts] = tiles_time(shape, ts, device)
        return memo[ts]

    widest = [(max(cost(ts).fwd for ts in step), max(cost(ts).bwd for ts in step)) for step in steps]
    fixed = _scaled(per_op(shape, shape.seq // pieces, block, [block] * n, device), device)
    return [f for f, _ in widest], [b for _, b in widest], fixed


_MEMO: dict = {}


def cp_compute(form: str, shape: AttnShape, sizes: tuple[int, ...], zigzag: bool, device):
    """``gather_compute`` (``form`` "attn_gather") or ``ring_compute`` ("attn_ring"), once per
    (form, shape, axes, order, device): the search asks again for every alike node and mesh."""
    key = (form, shape, sizes, zigzag, repr(device))
    hit = _MEMO.get(key)
    if hit is None:
        if len(_MEMO) > 4096:
            _MEMO.clear()
        fn = gather_compute if form == "attn_gather" else ring_compute
        hit = _MEMO[key] = fn(shape, sizes, zigzag, device)
    return hit
