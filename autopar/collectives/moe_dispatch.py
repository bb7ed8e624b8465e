"""Per-rank implementation of ``autopar::moe_experts`` (``frontend/moe_experts.py``).

``passes/insert_collectives.py`` replaces EVERY moe_experts node of a per-rank program by
:func:`moe_experts` (the custom op has no autograd), handing it ``_axes = {role: [axis names]}``:

* no role, or ``"batch"`` (tokens split, experts whole): the module's own forward on this rank's rows.
* ``"ep"`` (tokens split and experts split on the axis): de-duplicated dispatch, as Megatron-Core and
  DeepEP run it. A token whose k experts live on several ranks is sent ONCE to each of those ranks,
  as one bundle: its hidden row with its k routing weights side by side, and its k expert ids (a
  second, int32 all_to_all). A tiny all_to_all of per-destination bundle counts comes first
  (dropless: uneven counts), then one all_to_all (``all_to_all_single``, uneven splits) of the
  bundles. The owner runs its experts on the bundle's pairs that are its own (top-1 rows with local
  ids), sums them per bundle (the weighted k-sum, locally) and the reverse all_to_all brings ONE row
  per bundle back, where the sender adds the bundles of each token. Each data all_to_all's backward
  is the reverse all_to_all (:class:`_Exchange`, DESIGN invariant 5), so the router weights and the
  hidden rows get gradients.
* ``"experts"`` (tokens whole, experts split): only the rows routed to this rank's experts run; their
  results are added into a zero [T, H] output, which is Partial on the axis (the edge sums it).
* ``"etp"`` (tokens whole, each expert's FFN split on its intermediate dim, ``sharding/rules/moe.py``):
  nothing to move; the module's own forward on the rank's column/row pieces gives a Partial output
  (the down projection's bias arrives Partial: kept on one rank). On an ep axis beside it, the rows
  are dispatched as above and each etp rank runs its slice of their experts.

Several split axes compose: expert ``e`` lives on piece ``e // E_local`` of the expert dim split
over the ep and experts axes in mesh order (first outermost, as parameters are sharded); each ep
axis, in mesh order, is one hop: a bundle goes once to each coordinate along it that holds one of its
experts still bound for this rank (:func:`bundle_targets`). With the ep dim split as (node axis, in-node
axis) this is the two-hop, node-de-duplicated dispatch of DeepSeek-V3: one copy per destination node
across nodes, then the fan-out inside the node. An experts axis keeps the pairs whose owner's
coordinate along it is this rank's. ``sharding/local_impls.py`` lists the collectives this runs
(``_moe``; the copies per token are ``sharding/moe_routing.py``'s expectation); change both together.
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
    """Equal-split all_to_all of int64 counts (one per destination)."""
    out = torch.empty_like(counts)
    COUNTER.record("all_to_all", counts, ax.name, "fwd")
    dist.all_to_all_single(out, counts.contiguous(), group=ax.group)
    return out


class _Hop:
    """One ep axis's dispatch: which of the sender's rows each sent bundle copies, so the results come back."""

    def __init__(self, name: str, src: torch.Tensor, send: list[int], recv: list[int], rows: int):
        self.name, self.src, self.send, self.recv, self.rows = name, src, send, recv, rows


def bundle_targets(ids: torch.Tensor, digit, size: int, reached: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct (row, destination) pairs of one hop: row ``b`` (a bundle holding ``ids[b]``, its k expert
    ids) goes ONCE to each coordinate ``digit(id)`` along the axis among its pairs still bound here (those
    whose digits on the hops already made, ``reached = [(digit, my coordinate)]``, are this rank's).
    Returns (source rows, destinations), grouped by destination, then by source row."""
    bound = torch.ones_like(ids, dtype=torch.bool)
    for dg, coord in reached:
        bound &= dg(ids) == coord
    dest = torch.where(bound, digit(ids), size)
    hit = torch.zeros((ids.shape[0], size + 1), dtype=torch.bool, device=ids.device)
    hit.scatter_(1, dest, True)
    src, to = hit[:, :size].nonzero(as_tuple=True)          # row-major: by source row, then destination
    order = torch.argsort(to, stable=True)
    return src[order], to[order]


def _dispatch(name: str, digit, rows: list[torch.Tensor], ids: torch.Tensor, reached: list):
    """Send each bundle ONCE to every rank along axis ``name`` that holds one of its bound experts (its
    hidden row with all k weights, and its k expert ids). Returns the received rows and ids and the hop
    (for :func:`_combine`)."""
    ax = _axis(name)
    src, to = bundle_targets(ids, digit, ax.size, reached)
    send_t = torch.bincount(to, minlength=ax.size).to(torch.int64)
    recv_t = _counts_a2a(send_t, ax)
    send, recv = send_t.tolist(), recv_t.tolist()
    moved = [_Exchange.apply(r[src], send, recv, name) for r in rows]
    new_ids = _rows_a2a(ids[src].to(torch.int32), send, recv, ax, "fwd").to(torch.int64)
    return moved, new_ids, _Hop(name, src, send, recv, int(ids.shape[0]))


def _combine(y: torch.Tensor, hop: _Hop) -> torch.Tensor:
    """The results of the bundles ``hop`` received, back on their sender, summed into the rows they copied."""
    back = _Exchange.apply(y, hop.recv, hop.send, hop.name)
    return back.new_zeros((hop.rows, *back.shape[1:])).index_add(0, hop.src, back)


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
    k = top_k_index.shape[1]
    ids = top_k_index.to(torch.int64)
    same = top_k_weights.dtype == hidden.dtype
    rows = [torch.cat([hidden, top_k_weights], 1)] if same else [hidden, top_k_weights]
    hops, reached = [], []
    for n, size, st in zip(split, sizes, strides):
        if n in roles.get("ep", []):
            def digit(i, st=st, size=size):
                return torch.div(i, n_local * st, rounding_mode="floor") % size
            rows, ids, hop = _dispatch(n, digit, rows, ids, reached)
            hops.append(hop)
            reached.append((digit, bound[n].rank))
    x, w = (rows[0][:, :-k], rows[0][:, -k:]) if same else rows
    first = me * n_local
    b, j = ((ids >= first) & (ids < first + n_local)).nonzero(as_tuple=True)    # this rank's (bundle, k) pairs
    out = _run_rows(key, x[b], ids[b, j], w[b, j], params, first, n_local)
    y = x.new_zeros((x.shape[0], x.shape[1])).index_add(0, b, out.to(x.dtype))   # each bundle's local k-sum
    for hop in reversed(hops):
        y = _combine(y, hop)
    return y.to(hidden.dtype)
