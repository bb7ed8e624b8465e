"""The zig-zag order on a mesh axis: every split on the axis becomes its mirrored form.

Causal context parallelism balances its work by holding the sequence in the zig-zag order (rank
``r`` of ``n``: chunks ``r`` and ``2n-1-r`` of ``2n``), and every tensor cut along that sequence
must be cut alike (token ids, positions, masks, targets, the loss's rows). ``zigzag_candidates``
does it for a whole graph at once: on the given axes each ``Shard(d, k)`` of every candidate
strategy (inputs and outputs, placeholders included) becomes ``Shard(d, 2k, zigzag=True)``.

Why that keeps every strategy exact: the zig-zag form of a split is a fixed permutation of the
pieces, the same for two dims of equal length. A rule's strategy is correct for any choice of
index subset that its inputs and outputs share (elementwise ops, norms over other dims, the
batched dims of matmuls, embedding lookups, views whose blocks line up: ``[B, T] -> [B*T]`` with
``Z(1)`` is ``Z(0, 2B)``, each row halved) or that it sums over (a contraction or reduction over
the split dim gives ``Partial``). What depends on where a piece lies is excluded: positions
inside attention come from the placement (``sharding/cp_positions.py``), and the local
implementations that index by their piece (vocab-parallel embedding and loss, expert dispatch)
are dropped on these axes (``POSITION_FREE`` lists the ones that stay).
"""
from __future__ import annotations

import torch.fx as fx

from autopar.sharding.candidates import Candidates
from autopar.sharding.placements import zigzag_of
from autopar.sharding.strategy import Strategy, _spec_ok, out_shapes, shape_of, tensor_inputs

# local implementations (family:role) that do not depend on which piece a rank holds
POSITION_FREE = frozenset({"attn_gather:cp", "attn_ring:cp", "loss:batch", "mean:scale", "batch_norm:sync"})


def _spec(spec, axes) -> tuple:
    return type(spec)(zigzag_of(p) if a in axes else p for a, p in enumerate(spec))


def _multi(output) -> bool:
    return bool(output) and isinstance(output[0], tuple)


def zigzag_strategy(st: Strategy, axes: set[int]) -> Strategy | None:
    """``st`` with its splits on ``axes`` in the zig-zag order; None where a local implementation
    on those axes depends on the piece's position."""
    if any(st.local[a] and st.local[a] not in POSITION_FREE for a in axes):
        return None
    out = tuple(_spec(o, axes) for o in st.output) if _multi(st.output) else _spec(st.output, axes)
    return Strategy(tuple(_spec(i, axes) for i in st.inputs), out, st.local, st.name)


def _valid(node: fx.Node, st: Strategy, mesh_shape) -> bool:
    if node.op == "placeholder":
        return _spec_ok(shape_of(node) or None, st.output, mesh_shape)
    ins = [shape_of(a) for a in tensor_inputs(node)]
    if not all(_spec_ok(s, sp, mesh_shape) for s, sp in zip(ins, st.inputs)):
        return False
    outs = out_shapes(node)
    pairs = zip(outs, st.output) if _multi(st.output) and isinstance(outs, list) else [(outs, st.output)]
    return all(_spec_ok(s, sp, mesh_shape) for s, sp in pairs)


def zigzag_candidates(gm: fx.GraphModule, cands: Candidates, axes: set[int], mesh_shape) -> Candidates:
    """``cands`` with every strategy in the zig-zag order on ``axes`` (module doc): those that no
    longer divide evenly (a dim needs ``2n`` pieces) or depend on positions are left out."""
    by_name = {n.name: n for n in gm.graph.nodes}
    out = Candidates(unknown_ops=dict(cands.unknown_ops))
    done: dict[int, list] = {}      # id of a shared list (``candidates._shared_candidates``) -> its zig-zag form
    for name, strategies in cands.strategies.items():
        hit = done.get(id(strategies))
        if hit is None:
            hit = done[id(strategies)] = _zigzag_list(by_name[name], strategies, axes, mesh_shape)
        out.strategies[name] = hit
    return out


def _zigzag_list(node: fx.Node, strategies: list, axes: set[int], mesh_shape) -> list[Strategy]:
    """One node's list in the zig-zag order. Nodes holding the same list object are of one candidate
    class (equal input and output shapes), so they share the result."""
    seen, kept = set(), []
    for st in strategies:
        z = zigzag_strategy(st, axes)
        if z is None or not _valid(node, z, mesh_shape):
            continue
        key = (z.inputs, z.output, z.local)
        if key not in seen:
            seen.add(key)
            kept.append(z)
    return kept or strategies[:1]
