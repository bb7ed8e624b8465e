"""Context-parallel attention: ``scaled_dot_product_attention`` with q, k, v split along the
sequence over mesh axes (``sharding/rules/attention.py``'s ``"cp"`` strategies).

Each rank holds the queries, keys and values of its piece of the sequence as the placement cuts
it: contiguous pieces (``Shard(dim)``, the first axis outermost) or, under causal attention, the
zig-zag order (``Z(dim)``, ``_zigzag=True``: rank ``r`` of ``n`` holds chunks ``r`` and
``2n-1-r`` of ``2n``); a mask arrives with its query dim split alike and its key dim whole.
Positions are explicit and come from the placement (``cp_positions.held`` cuts and gathers an
``arange`` as the runtime cuts and gathers the tensors): a key at global position ``j`` is
visible to a query at ``i`` under ``is_causal`` iff ``j <= i`` (torch's top-left causal mask of
the unsplit op), and mask columns are picked by the keys' positions.

* ``attention_gather`` (Llama 3): all-gather K and V in the placement's order
  (``comm.all_gather_rs``: backward reduce-scatters their gradients, which are partial per rank),
  then the op itself on this rank's queries with the causal mask at their positions.
* ``attention_ring`` (ring attention): ``_RingAttention`` passes the K/V blocks around the ring
  of the last cp axis with ``batch_isend_irecv`` while computing on the block it holds, merges
  the blocks' outputs by their log-sum-exp, and in backward recomputes each block's softmax from
  the saved log-sum-exp while the blocks travel again with their gradient accumulators (one more
  hop brings the gradients home). Further cp axes are all-gathered first as in the gather form.
  Each block is cut into tiles at its runs of consecutive positions (``cp_positions.tiles``, once per
  layer shape from positions computed on the CPU, ``block_cuts``: no device sync in the loop):
  tiles entirely above the causal diagonal are skipped (the block is still forwarded), wholly
  visible ones and the diagonal squares run on the device's fused flash kernel where it has one
  (``fused_blocks.py``: the CPU; CUDA in fp16 / bf16), the rest explicitly.

Load balance under a causal mask: with contiguous pieces rank ``r`` of ``n`` attends to ``r+1``
blocks, so the last rank does about ``(2n-1)/n`` times the mean work. In the zig-zag order every
rank does the same: its own block is two diagonal squares and one full tile, and every other
block is half visible (the earlier ranks' head chunks to all its queries, the later ranks' both
chunks to its tail's queries), so after the first step each ring step computes half a block on
every rank. The order is a property of the placement of every tensor on the axis (token ids,
rotary positions, masks, targets and the loss all follow it: ``sharding/zigzag.py``), not of
this op: a permutation inside the op would cost two all-to-alls of q, k, v and the output per
layer and per direction. ``zigzag_chunks`` and ``causal_flops_per_rank`` count the balance
(``tests/unit/test_zigzag.py`` counts it from the ring's tiles too); the cost model charges it
(``cost_models/context_parallel.py``).

The collectives each runs are listed in ``sharding/local_impls.py`` (``_attn_gather``,
``_attn_ring``): change both together.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch.ops import aten

from autopar.collectives import comm, fused_blocks
from autopar.sharding.cp_positions import held, tiles
from autopar.collectives.groups import axis as _axis


# ---- positions and the balance of a causal split --------------------------------------------

def zigzag_chunks(rank: int, n: int) -> tuple[int, int]:
    """The zig-zag (head-tail) order: rank ``r`` of ``n`` holds chunks ``r`` and ``2n-1-r`` of ``2n``."""
    return rank, 2 * n - 1 - rank


def causal_flops_per_rank(seq: int, chunks_of: list[list[int]], n_chunks: int, head_dim: int = 1) -> list[int]:
    """Multiply-adds of causal attention (QK^T and PV, unmasked entries only) per rank, when rank
    ``r`` holds the queries of the chunks ``chunks_of[r]`` of ``n_chunks`` equal chunks."""
    size = seq // n_chunks
    out = []
    for chunks in chunks_of:
        entries = sum(sum(c * size + i + 1 for i in range(size)) for c in chunks)
        out.append(2 * entries * head_dim)
    return out


def _split_axes(names: list[str]) -> list[str]:
    """The axes that split: an axis of size 1 holds the whole dim and runs nothing."""
    return [a for a in names if _axis(a).size > 1]


# ---- masks ------------------------------------------------------------------------------

def _mask_scores(s: torch.Tensor, mask, visible) -> torch.Tensor:
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    return s


def _join_masks(mask, visible: torch.Tensor):
    if mask is None:
        return visible
    if mask.dtype == torch.bool:
        return mask & visible
    return mask.masked_fill(~visible, float("-inf"))


# ---- all-gather form ----------------------------------------------------------------------

def _gather_kv(key, value, axes: list[str], zigzag: bool = False):
    """K and V gathered along the sequence over ``axes`` (innermost first: pieces in order), in
    the placement's order (``Z(dim)`` under ``zigzag``)."""
    chunks = 2 if zigzag else 1
    for name in reversed(axes):
        key = comm.all_gather_rs(key, key.dim() - 2, name, chunks, zigzag)
        value = comm.all_gather_rs(value, value.dim() - 2, name, chunks, zigzag)
    return key, value


def _coords(axes: list[str]) -> tuple[list[int], list[int]]:
    return [_axis(a).size for a in axes], [_axis(a).rank for a in axes]


def attention_gather(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False, *, _op, _axes, _zigzag=False):
    """Llama 3's context parallelism: gather K/V, attend with this rank's queries."""
    axes = _split_axes(_axes["cp"])
    key, value = _gather_kv(key, value, axes, _zigzag)
    if is_causal:
        sizes, coords = _coords(axes)
        total = key.shape[-2]
        rows = held(total, sizes, coords, _zigzag, device=query.device)
        keys = held(total, sizes, coords, _zigzag, tuple(reversed(range(len(axes)))), query.device)
        if attn_mask is None and not dropout_p and fused_blocks.runs_fused(query):
            scale = query.shape[-1] ** -0.5 if scale is None else scale
            return _TiledAttention.apply(query, key, value, rows, keys, scale,
                                         block_cuts(total, tuple(sizes), tuple(coords), _zigzag, True, gathered=True)[0])
        visible = keys <= rows.unsqueeze(-1)
        attn_mask = _join_masks(attn_mask, visible)
    return aten.scaled_dot_product_attention.default(query, key, value, attn_mask, dropout_p, False, scale=scale,
                                                     enable_gqa=enable_gqa)


# ---- ring form ------------------------------------------------------------------------------

def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """K/V heads repeated for grouped-query attention (torch's ``enable_gqa`` order)."""
    return t if t.shape[-3] == heads else t.repeat_interleave(heads // t.shape[-3], dim=-3)


def _fold(g: torch.Tensor, heads: int) -> torch.Tensor:
    """The gradient of ``_expand``: sum over each group of repeated heads."""
    if g.shape[-3] == heads:
        return g
    return g.unflatten(-3, (heads, g.shape[-3] // heads)).sum(-3)


class _Ring:
    """One rank's ring over an axis: send the held tensors on, receive the previous rank's."""

    def __init__(self, ax, phase: str):
        self.ax, self.phase = ax, phase
        n, r = self.ax.size, self.ax.rank
        self.next = dist.get_global_rank(self.ax.group, (r + 1) % n)
        self.prev = dist.get_global_rank(self.ax.group, (r - 1) % n)

    def start(self, tensors: list[torch.Tensor]):
        tensors = [t.contiguous() for t in tensors]
        got = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.ax.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.ax.group) for t in got]
        for t in tensors:
            comm.COUNTER.record("send_recv", t, self.ax.name, self.phase)
        return dist.batch_isend_irecv(ops), got

    @staticmethod
    def finish(pending) -> list[torch.Tensor]:
        reqs, got = pending
        for req in reqs:
            req.wait()
        return got


def _attend(q, kb, vb, mask, qpos, kpos, causal, scale, out, lse, aux: dict, cut=None) -> None:
    """Merge the attention of ``q`` to one block of keys (at ``kpos``) into ``out`` and ``lse``,
    tile by tile (``cut``: the block's ``cp_positions.tiles``, cut from the positions when not given);
    ``aux`` keeps a fused forward's auxiliary outputs for the backward (``fused_blocks``)."""
    heads = q.shape[-3]
    kb, vb = _expand(kb, heads), _expand(vb, heads)
    for qs, ks, tile in tiles(qpos, kpos, causal) if cut is None else cut:
        qt, qp, kp = _rows(q, qs), qpos[qs], kpos[ks]
        kt, vt, mt = _rows(kb, ks), _rows(vb, ks), _mask_rows(mask, qs)
        fused = fused_blocks.kind(qt, mt, tile)
        if fused is None:
            o_b, lse_b = _block_forward(qt, kt, vt, scale, *_block_args(mt, qp, kp, causal))
        else:
            o_b, lse_b, aux["fused"] = fused_blocks.forward(qt, kt, vt, scale, fused == "causal")
        o_m, lse_m = _merge(_rows(out, qs), _rows(lse, qs, -1), o_b.to(_acc(q)), lse_b)
        _put(out, qs, o_m)
        _put(lse, qs, lse_m, -1)


def _attend_grad(q, kb, vb, mask, qpos, kpos, causal, scale, g, out, lse, delta, dq, dk, dv, aux: dict,
                 cut=None) -> None:
    """Add one block's gradients (from the merged ``out`` and ``lse``) into ``dq`` and the block's
    ``dk``, ``dv`` accumulators, tile by tile (``cut`` as for ``_attend``)."""
    heads = q.shape[-3]
    kb, vb = _expand(kb, heads), _expand(vb, heads)
    for qs, ks, tile in tiles(qpos, kpos, causal) if cut is None else cut:
        qt, qp, kp = _rows(q, qs), qpos[qs], kpos[ks]
        kt, vt, mt, gt = _rows(kb, ks), _rows(vb, ks), _mask_rows(mask, qs), _rows(g, qs)
        fused = fused_blocks.kind(qt, mt, tile)
        if fused is None:
            dq_b, dk_b, dv_b = _block_backward(qt, kt, vt, gt, _rows(lse, qs, -1), _rows(delta, qs, -1), scale,
                                               *_block_args(mt, qp, kp, causal))
        else:
            dq_b, dk_b, dv_b = fused_blocks.backward(qt, kt, vt, gt, _rows(out, qs), _rows(lse, qs, -1), scale,
                                                     fused == "causal", aux.get("fused"))
        _add(dq, qs, dq_b)
        _add(dk, ks, _fold(dk_b, dk.shape[-3]))
        _add(dv, ks, _fold(dv_b, dv.shape[-3]))


def _start(q, v):
    """Empty merged output and log-sum-exp (accumulation dtype)."""
    out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=_acc(q), device=q.device)
    return out, torch.full(q.shape[:-1], float("-inf"), dtype=_acc(q), device=q.device)


class _RingAttention(torch.autograd.Function):
    """Exact attention of local queries against K/V blocks passed around a ring (see module doc).
    ``kpos[s]``: global positions of the keys held by ring rank ``s``; ``qpos``: this rank's queries'."""

    @staticmethod
    def forward(ctx, q, k, v, mask, qpos, kpos, causal, scale, name, cuts):
        ring = _Ring(_axis(name), "fwd")
        n, r = ring.ax.size, ring.ax.rank
        out, lse = _start(q, v)
        blk, aux = [k, v], {}
        for step in range(n):
            pending = ring.start(blk) if step < n - 1 else None
            src = (r - step) % n
            _attend(q, blk[0], blk[1], mask, qpos, kpos[src], causal, scale, out, lse, aux, cuts[src])
            if pending is not None:
                blk = _Ring.finish(pending)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, mask, qpos, kpos, out, lse)
        ctx.causal, ctx.scale, ctx.ax, ctx.aux = causal, scale, ring.ax, aux  # backward runs outside the bound axes
        ctx.cuts = cuts
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, mask, qpos, kpos, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.ax, "bwd")
        n, r = ring.ax.size, ring.ax.rank
        g = g.contiguous()
        delta = (g.to(_acc(q)) * out.to(_acc(q))).sum(-1)
        dq = torch.zeros_like(q, dtype=_acc(q))
        blk = [k, v, torch.zeros_like(k, dtype=_acc(q)), torch.zeros_like(v, dtype=_acc(q))]
        for step in range(n):
            pending = ring.start(blk[:2]) if step < n - 1 else None
            src = (r - step) % n
            _attend_grad(q, blk[0], blk[1], mask, qpos, kpos[src], ctx.causal, ctx.scale, g, out, lse,
                         delta, dq, blk[2], blk[3], ctx.aux, ctx.cuts[src])
            grads = _Ring.finish(ring.start(blk[2:]))     # the accumulators move on with their block
            if pending is not None:
                blk[:2] = _Ring.finish(pending)
            blk[2:] = grads
        return dq.to(q.dtype), blk[2].to(k.dtype), blk[3].to(v.dtype), None, None, None, None, None, None, None


class _TiledAttention(torch.autograd.Function):
    """Causal attention of local queries (at ``qpos``) to the gathered keys (at ``kpos``) as fused
    calls, one per tile (what precedes a query run, without a mask; its diagonal square,
    ``is_causal``), merged by log-sum-exp: the gather form without a mask tensor where the device has
    the fused kernel (``fused_blocks.runs_fused``). A mask tensor would send SDPA to its math kernel
    on the CPU (it saves the attention weights) and to a masked kernel at about half the causal one's
    rate on CUDA. Saves q, K, V, the output and the log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, qpos, kpos, scale, cut):
        out, lse = _start(q, v)
        aux = {}
        _attend(q, k, v, None, qpos, kpos, True, scale, out, lse, aux, cut)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, qpos, kpos, out, lse)
        ctx.scale, ctx.aux, ctx.cut = scale, aux, cut
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, qpos, kpos, out, lse = ctx.saved_tensors
        g = g.contiguous()
        delta = (g.to(_acc(q)) * out.to(_acc(q))).sum(-1)
        dq, dk, dv = (torch.zeros_like(t, dtype=_acc(q)) for t in (q, k, v))
        _attend_grad(q, k, v, None, qpos, kpos, True, ctx.scale, g, out, lse, delta, dq, dk, dv, ctx.aux, ctx.cut)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _whole(t: torch.Tensor, s: slice, dim: int) -> bool:
    return s.start == 0 and s.stop == t.shape[dim]


def _rows(t: torch.Tensor, s: slice, dim: int = -2) -> torch.Tensor:
    """Positions ``s`` of ``t`` along ``dim`` (a tile's queries or keys), contiguous."""
    return t if _whole(t, s, dim) else t.narrow(dim, s.start, s.stop - s.start).contiguous()


def _mask_rows(mask, s: slice):
    """A tile's rows of the mask (its query dim split like the queries; whole where it broadcasts)."""
    if mask is None or mask.dim() < 2 or mask.shape[-2] == 1:
        return mask
    return _rows(mask, s)


def _put(t: torch.Tensor, s: slice, value: torch.Tensor, dim: int = -2) -> None:
    if _whole(t, s, dim):
        t.copy_(value)
    else:
        t.narrow(dim, s.start, s.stop - s.start).copy_(value)


def _add(t: torch.Tensor, s: slice, value: torch.Tensor) -> None:
    if _whole(t, s, -2):
        t.add_(value)
    else:
        t.narrow(-2, s.start, s.stop - s.start).add_(value)


def _acc(q: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: float32 for low-precision inputs, the inputs' own otherwise."""
    return torch.promote_types(q.dtype, torch.float32)


def _block_args(mask, qpos, kpos, causal):
    """(mask columns of the block, visibility) or None where the causal mask hides the whole block."""
    if causal and int(kpos.min()) > int(qpos.max()):
        return None
    cols = None if mask is None or mask.shape[-1] == 1 else mask.index_select(-1, kpos)
    cols = mask if cols is None else cols
    visible = kpos <= qpos.unsqueeze(-1) if causal else None
    return cols, visible


def _scores(q, kb, scale, cols, visible):
    s = torch.matmul(q.to(_acc(q)), kb.to(_acc(q)).transpose(-1, -2)) * scale
    return _mask_scores(s, cols, visible)


def _block_forward(q, kb, vb, scale, cols, visible):
    s = _scores(q, kb, scale, cols, visible)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    return torch.matmul(p, vb.to(_acc(q))), lse


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _merge(out, lse, o_b, lse_b):
    new = torch.logaddexp(lse, lse_b)
    safe = _finite(new)
    w, w_b = torch.exp(lse - safe).unsqueeze(-1), torch.exp(lse_b - safe).unsqueeze(-1)
    return (out.to(o_b.dtype) * w + o_b * w_b).to(out.dtype), new


def _block_backward(q, kb, vb, g, lse, delta, scale, cols, visible):
    s = _scores(q, kb, scale, cols, visible)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    gf = g.to(_acc(q))
    dv = torch.matmul(p.transpose(-1, -2), gf)
    ds = p * (torch.matmul(gf, vb.to(_acc(q)).transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(ds, kb.to(_acc(q))) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(_acc(q))) * scale
    return dq, dk, dv


def attention_ring(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, *, _op, _axes, _zigzag=False):
    """Ring attention over the last ``"cp"`` axis (further cp axes all-gathered first)."""
    axes = _split_axes(_axes["cp"])
    if not axes:
        return aten.scaled_dot_product_attention.default(query, key, value, attn_mask, dropout_p, is_causal,
                                                         scale=scale, enable_gqa=enable_gqa)
    if dropout_p:
        raise ValueError("this plan runs ring attention on an attention op with dropout, which the ring form does "
                         "not support (the solver offers only the all-gather form there): use dropout_p=0 or make "
                         "a new plan")
    sizes, coords = _coords(axes)
    total = query.shape[-2] * math.prod(sizes)
    key, value = _gather_kv(key, value, axes[:-1], _zigzag)
    qpos = held(total, sizes, coords, _zigzag, device=query.device)
    outer = tuple(reversed(range(len(axes) - 1)))
    kpos = torch.stack([held(total, sizes, coords[:-1] + [src], _zigzag, outer, query.device)
                        for src in range(sizes[-1])])
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    cuts = block_cuts(total, tuple(sizes), tuple(coords), _zigzag, bool(is_causal))
    return _RingAttention.apply(query, key, value, attn_mask, qpos, kpos, bool(is_causal), scale, axes[-1], cuts)


@functools.lru_cache(maxsize=256)
def block_cuts(total: int, sizes: tuple, coords: tuple, zigzag: bool, causal: bool,
               gathered: bool = False) -> tuple:
    """The tiles (``cp_positions.tiles``) of each key block a rank's queries meet, cut once per layer shape
    from positions computed on the CPU: cutting them from the device's positions at every block would
    wait for the device (a sync per call). The ring's blocks, by source rank on the last cp axis (the
    outer axes gathered first); ``gathered``: the one block of every rank's keys (the gather form)."""
    qpos = held(total, list(sizes), list(coords), zigzag)
    if gathered:
        return (tiles(qpos, held(total, list(sizes), list(coords), zigzag, tuple(reversed(range(len(sizes))))),
                      causal),)
    outer = tuple(reversed(range(len(sizes) - 1)))
    return tuple(tiles(qpos, held(total, list(sizes), list(coords[:-1]) + [src], zigzag, outer), causal)
                 for src in range(sizes[-1]))
