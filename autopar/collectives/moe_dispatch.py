"""Per-rank implementation of ``autopar::moe_experts`` (``frontend/moe_experts.py``).

``passes/insert_collectives.py`` replaces EVERY moe_experts node of a per-rank program by
:func:`moe_experts` (the custom op has no autograd), handing it ``_axes = {role: [axis names]}``:

* no role, or ``"batch"`` (tokens split, experts whole): the module's own forward on this rank's rows.
* ``"ep"`` (tokens split and experts split on the axis): the (token, k) rows are sorted by the rank
  owning their expert; a tiny all_to_all of per-expert row counts tells every rank what it receives
  (dropless: uneven counts), then one all_to_all (``all_to_all_single``, uneven splits) sends each row
  (hidden row and its routing weight side by side) to its owner, which runs its experts on them as
  top-1 rows with local expert ids; the reverse all_to_all brings the weighted results back, and
  each token sums its k rows. Each data all_to_all's backward is the reverse all_to_all
  (:class:`_Exchange`, DESIGN invariant 5), so the router weights and the hidden rows get gradients.
* ``"experts"`` (tokens whole, experts split): only the rows routed to this rank's experts run; their
  results are added into a zero [T, H] output, which is Partial on the axis (the edge sums it).
* ``"etp"`` (tokens whole, each expert's FFN split on its intermediate dim, ``sharding/rules/moe.py``):
  nothing to move; the module's own forward on the rank's column/row pieces gives a Partial output
  (the down projection's bias arrives Partial: kept on one rank). On an ep axis beside it, the rows
  are dispatched as above and each etp rank runs its slice of their experts.

Several split axes compose: expert ``e`` lives on piece ``e // E_local`` of the expert dim split
over the ep and experts axes in mesh order (first outermost, as parameters are sharded); each ep
axis, in mesh order, moves rows to the coordinate of their owner's piece along it, and an experts
axis keeps the rows whose owner's coordinate along it is this rank's. ``sharding/local_impls.py``
lists the collectives this runs (``_moe``); change both together.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.collectives.comm import COUNTER
from autopar.collectives.groups import axis as _axis, current_axes
from autopar.frontend.moe_experts import entry, run_experts


def _rows_a2a(x: torch.Tensor, send: list[int], recv: list[int], ax, phase: str) -> torch.Tensor:
    """Rows of ``x`` (grouped by destination, ``send[r]`` to rank r) in, rows from each source out."""
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    COUNTER.record("all_to_all", x, ax.name, phase)
    dist.all_to_all_single(out, x, recv, send, group=ax.group)
    return out


class _Exchange(torch.autograd.Function):
    """Uneven all_to_all of rows; backward: the reverse all_to_all of the gradient rows."""

    @staticmethod
    def forward(ctx, x, send, recv, name):
        ctx.ax, ctx.send, ctx.recv = _axis(name), send, recv
        return _rows_a2a(x, send, recv, ctx.ax, "fwd")

    @staticmethod
    def backward(ctx, g):
        return _rows_a2a(g, ctx.recv, ctx.send, ctx.ax, "bwd"), None, None, None


def _counts_a2a(counts: torch.Tensor, ax) -> torch.Tensor:
    """Equal-split all_to_all of int64 counts (one block per destination, same size for all)."""
    out = torch.empty_like(counts)
    COUNTER.record("all_to_all", counts, ax.name, "fwd")
    dist.all_to_all_single(out, counts.contiguous(), group=ax.group)
    return out


class _Hop:
    """One ep axis's dispatch: what went where, so the results can come back."""

    def __init__(self, name: str, order: torch.Tensor, send: list[int], recv: list[int]):
        self.name, self.order, self.send, self.recv = name, order, send, recv


def _dispatch(name: str, digit, rows: list[torch.Tensor], ids: torch.Tensor, num_experts: int):
    """Send each row to the rank along axis ``name`` whose coordinate is ``digit(expert id)``.
    Returns the received rows, their global expert ids and the hop (for :func:`_combine`)."""
    ax = _axis(name)
    dest = digit(ids)
    # rows grouped by destination, then by expert: the receiver rebuilds the ids from counts. The experts
    # grouped alike (``by_dest``: each destination's experts, ascending) in one sort: a fixed number of
    # kernels and two host reads per hop, whatever the axis size
    order = torch.argsort(dest * num_experts + ids, stable=True)
    experts = torch.arange(num_experts, device=ids.device)
    owner = digit(experts)
    by_dest = experts[torch.argsort(owner * num_experts + experts, stable=True)]
    per_expert = torch.bincount(ids, minlength=num_experts)
    counts = per_expert[by_dest].to(torch.int64)
    got = _counts_a2a(counts, ax).view(ax.size, -1)
    send = torch.bincount(dest, minlength=ax.size).tolist()
    recv = got.sum(1).tolist()
    mine = experts[owner == ax.rank]
    new_ids = mine.repeat(ax.size).repeat_interleave(got.reshape(-1))
    moved = [_Exchange.apply(r[order], send, recv, name) for r in rows]
    return moved, new_ids, _Hop(name, order, send, recv)


def _combine(y: torch.Tensor, hop: _Hop) -> torch.Tensor:
    """The results of the rows ``hop`` received, back on their sender, in the sender's original order."""
    back = _Exchange.apply(y, hop.recv, hop.send, hop.name)
    inv = torch.empty_like(hop.order)
    inv[hop.order] = torch.arange(hop.order.numel(), device=hop.order.device)
    return back[inv]


def _run_rows(key, x, ids, w, params, first: int, n_local: int) -> torch.Tensor:
    """Weighted expert outputs of top-1 rows whose experts are ``first .. first + n_local - 1``.
    With no rows, one zero-weight row runs (sliced away) so the parameters still get (zero) gradients."""
    if x.shape[0] == 0:
        pad = x.new_zeros((1, x.shape[1]))
        out = run_experts(key, pad, ids.new_zeros((1, 1)), w.new_zeros((1, 1)), params, n_local)
        return out[:0] + (x.sum() + w.sum()) * 0
    return run_experts(key, x, (ids - first).unsqueeze(1), w.unsqueeze(1), params, n_local)


def moe_experts(key, hidden, top_k_index, top_k_weights, params, *, _op=None, _axes=None):
    """Replaces ``autopar::moe_experts`` in per-rank programs (see the module docstring)."""
    e = entry(key)
    roles = _axes or {}
    unknown = set(roles) - {"batch", "ep", "experts", "etp"}
    if unknown:
        raise RuntimeError(f"autopar::moe_experts {e.name}: unknown role(s) {sorted(unknown)} in the plan; make a new "
                           "plan with this version of autopar")
    bound = current_axes() or {}
    split = [n for n in bound if n in roles.get("ep", []) or n in roles.get("experts", [])]
    split = [n for n in split if bound[n].size > 1]
    if not split:
        return run_experts(key, hidden, top_k_index, top_k_weights, list(params))
    params = list(params)
    n_local = int(params[0].shape[0])
    sizes = [bound[n].size for n in split]
    pieces = 1
    for s in sizes:
        pieces *= s
    if n_local * pieces != e.num_experts:
        raise RuntimeError(f"autopar::moe_experts {e.name}: this rank holds {n_local} of {e.num_experts} experts but "
                           f"the expert dim is split {pieces} ways over {split}; the plan does not match the model")
    strides = [1] * len(split)
    for i in range(len(split) - 2, -1, -1):
        strides[i] = strides[i + 1] * sizes[i + 1]
    me = sum(bound[n].rank * st for n, st in zip(split, strides))
    T, k = top_k_index.shape
    tokens = torch.arange(T, device=hidden.device).repeat_interleave(k)
    x, w, ids = hidden[tokens], top_k_weights.reshape(-1), top_k_index.reshape(-1).to(torch.int64)
    same = w.dtype == x.dtype
    rows = [torch.cat([x, w.unsqueeze(1)], 1)] if same else [x, w]
    hops = []
    for n, size, st in zip(split, sizes, strides):
        if n in roles.get("ep", []):
            def digit(i, st=st, size=size):
                return torch.div(i, n_local * st, rounding_mode="floor") % size
            rows, ids, hop = _dispatch(n, digit, rows, ids, e.num_experts)
            hops.append(hop)
    x, w = (rows[0][:, :-1], rows[0][:, -1]) if same else rows
    first = me * n_local
    if any(n in roles.get("experts", []) for n in split):
        keep = ((ids >= first) & (ids < first + n_local)).nonzero().squeeze(1)
        out = _run_rows(key, x[keep], ids[keep], w[keep], params, first, n_local)
        y = x.new_zeros((x.shape[0], x.shape[1])).index_add(0, keep, out.to(x.dtype))
    else:
        y = _run_rows(key, x, ids, w, params, first, n_local).to(x.dtype)
    for hop in reversed(hops):
        y = _combine(y, hop)
    return y.view(T, k, -1).sum(1).to(hidden.dtype)
