"""Local implementations: ops whose sharded form needs more than the op on local pieces.

A rule marks such a strategy with ``AxisStrategy.local = "family:role"`` on the mesh axes it
splits (``"loss:vocab"``, ``"batch_norm:sync"``, ...); ``passes/insert_collectives`` replaces
the op with ``collectives/local_ops.py``'s implementation of the family, handing it
``{role: [axis names]}``. This module is the one description of the collectives each family
runs: ``solver/decode.py`` lists them in the plan, ``solver/strategy_prices.py`` costs them (the sum
of their times), and ``tests/ranks/test_local_impls.py`` checks that every name a rule can produce
has an entry here and an implementation in ``local_ops``. Bytes are what ``local_ops`` sends
(the traced value's item size, the local row count), one call per axis in axis order.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.graph.grads import grad_nodes
from autopar.sharding.moe_routing import copies_per_token as dispatch_copies
from autopar.sharding.placements import local_shape, shard_factor
from autopar.sharding.strategy import Strategy, tensor_inputs

# (kind, bytes, mesh axis, phase): one collective a local implementation runs per step
LocalCollective = tuple[str, float, int, str]


@dataclass(frozen=True)
class LocalImpl:
    """A family of local implementations: the roles its axes may take, and the collectives it
    runs for a node given ``{role: [mesh axes of size > 1]}``."""

    roles: tuple[str, ...]
    collectives: Callable[[fx.Node, Strategy, dict, tuple], list[LocalCollective]]


def _itemsize(node: fx.Node) -> int:
    v = node.meta.get("val")
    return v.element_size() if isinstance(v, torch.Tensor) else 4


def _loss(node: fx.Node, st: Strategy, roles: dict, mesh_shape) -> list[LocalCollective]:
    """``local_ops.cross_entropy_loss``: split classes (Megatron) all-reduce each local row's
    max, then its (sum-exp, target logit) pair, over every vocab axis; a mean then sums the
    valid-target count (one item) over the batch axes, as the batch-split loss alone does."""
    logits, target = tensor_inputs(node)[:2]
    size = _itemsize(logits)
    reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
    v = target.meta.get("val")
    rows = (v.numel() if isinstance(v, torch.Tensor) else 0) / shard_factor(st.inputs[1], mesh_shape)
    vocab = roles.get("vocab", [])
    out = [("all_reduce", rows * size, ax, "fwd") for ax in vocab]
    out += [("all_reduce", 2 * rows * size, ax, "fwd") for ax in vocab]
    if reduction == 1:
        out += [("all_reduce", size, ax, "fwd") for ax in roles.get("batch", [])]
    return out


def _batch_norm(node: fx.Node, st: Strategy, roles: dict, mesh_shape) -> list[LocalCollective]:
    """``local_ops.batch_norm``: the sums of the mean, then of the variance, of this rank's
    channels (the channel dim may be split on other axes) over every sync axis; backward, when
    the input needs a gradient, their gradients likewise."""
    x = tensor_inputs(node)[0]
    v = x.meta["val"]
    nbytes = local_shape(v.shape, st.inputs[0], mesh_shape)[1] * v.element_size()
    sync = roles.get("sync", [])
    out = [("all_reduce", nbytes, ax, "fwd") for _ in range(2) for ax in sync]
    if x in grad_nodes(node.graph):
        out += [("all_reduce", nbytes, ax, "bwd") for _ in range(2) for ax in sync]
    return out


def _moe(node: fx.Node, st: Strategy, roles: dict, mesh_shape) -> list[LocalCollective]:
    """``collectives/moe_dispatch.py`` (de-duplicated dispatch): per ep axis in mesh order, forward, an
    all_to_all of the per-destination copy counts (one int64 per rank), one of the copies (hidden row and
    the token's k routing weights side by side; two, hidden then weights, when their dtypes differ) and one
    of their k expert ids (int32); then, in reverse axis order, one result row per copy back. Copies per
    local token on hop i: ``dispatch_copies`` (``sharding/moe_routing.py``: the expected count of distinct
    destinations, uniform or group-limited routing). Backward, when the node needs a gradient, each data
    all_to_all reversed: the results' in axis order, then the copies' in reverse order."""
    ep = roles.get("ep", [])
    if not ep:
        return []
    hidden, index, weights = tensor_inputs(node)[:3]
    h, idx, w = (a.meta["val"] for a in (hidden, index, weights))
    k = int(idx.shape[-1])
    tokens = idx.numel() / k / shard_factor(st.inputs[1], mesh_shape)
    width = h.shape[-1]
    num_experts = int(tensor_inputs(node)[3].meta["val"].shape[0])
    split = sorted(set(ep) | set(roles.get("experts", [])))
    copies = dispatch_copies(node.args[0], num_experts, k, [mesh_shape[a] for a in split], [a in ep for a in split])
    fwd, bwd, backs = [], [], []
    for ax, d in zip(ep, copies):
        rows = tokens * d
        sends = ([rows * (width + k) * h.element_size()] if w.dtype == h.dtype
                 else [rows * width * h.element_size(), rows * k * w.element_size()])
        fwd += [("all_to_all", 8.0 * mesh_shape[ax], ax, "fwd")] + [("all_to_all", b, ax, "fwd") for b in sends]
        fwd.append(("all_to_all", rows * k * 4.0, ax, "fwd"))
        backs.append(rows * width * h.element_size())
        bwd = [("all_to_all", b, ax, "bwd") for b in reversed(sends)] + bwd
    fwd += [("all_to_all", b, ax, "fwd") for ax, b in reversed(list(zip(ep, backs)))]
    if node not in grad_nodes(node.graph):
        return fwd
    out = fwd + [("all_to_all", b, ax, "bwd") for ax, b in zip(ep, backs)]
    if hidden in grad_nodes(node.graph) or weights in grad_nodes(node.graph):
        out += bwd
    return out


def _kv_bytes(node: fx.Node, st: Strategy, mesh_shape, i: int, itemsize: int | None = None) -> float:
    """Bytes of this rank's piece of input ``i`` (1: keys, 2: values)."""
    v = tensor_inputs(node)[i].meta["val"]
    return v.numel() / shard_factor(st.inputs[i], mesh_shape) * (itemsize or v.element_size())


def _gathers(node, st, mesh_shape, axes, grads: bool) -> tuple[list[LocalCollective], list[float]]:
    """``attention_cp._gather_kv``: K then V all-gathered over each axis, innermost first (each
    gather's bytes its output); backward, where they need gradients, reduce-scatters of the same
    sizes. Returns the list and the K/V bytes gathered."""
    sizes, out = [_kv_bytes(node, st, mesh_shape, 1), _kv_bytes(node, st, mesh_shape, 2)], []
    for ax in reversed(axes):
        sizes = [b * mesh_shape[ax] for b in sizes]
        out += [("all_gather", b, ax, "fwd") for b in sizes]
        out += [("reduce_scatter", b, ax, "bwd") for i, b in enumerate(sizes) if grads[i]]
    return out, sizes


def _attn_gather(node: fx.Node, st: Strategy, roles: dict, mesh_shape) -> list[LocalCollective]:
    """``attention_cp.attention_gather``: K and V gathered along the sequence over the cp axes."""
    need = grad_nodes(node.graph)
    grads = [a in need for a in tensor_inputs(node)[1:3]]
    return _gathers(node, st, mesh_shape, roles.get("cp", []), grads)[0]


def _attn_ring(node: fx.Node, st: Strategy, roles: dict, mesh_shape) -> list[LocalCollective]:
    """``attention_cp.attention_ring``: over the last cp axis (n ranks) K and V each hop n-1 times
    forward; backward they hop n-1 times again and their gradient accumulators (at least fp32)
    n times. Further cp axes are gathered first (``_gathers``)."""
    axes = roles.get("cp", [])
    if not axes:
        return []
    need = grad_nodes(node.graph)
    ins = tensor_inputs(node)
    out, kv = _gathers(node, st, mesh_shape, axes[:-1], [a in need for a in ins[1:3]])
    ring, n = axes[-1], mesh_shape[axes[-1]]
    out += [("send_recv", b, ring, "fwd") for _ in range(n - 1) for b in kv]
    if any(a in need for a in ins[:3]):
        grad = [b / _itemsize(a) * max(_itemsize(a), 4) for a, b in zip(ins[1:3], kv)]
        out += [("send_recv", b, ring, "bwd") for _ in range(n - 1) for b in kv]
        out += [("send_recv", b, ring, "bwd") for _ in range(n) for b in grad]
    return out


def _none(node, st, roles, mesh_shape) -> list[LocalCollective]:
    return []


LOCAL_IMPLS: dict[str, LocalImpl] = {
    "loss": LocalImpl(("batch", "vocab"), _loss),
    "batch_norm": LocalImpl(("sync",), _batch_norm),
    "embedding": LocalImpl(("vocab",), _none),     # masked lookup, Partial out: the edge sums it
    "mean": LocalImpl(("scale",), _none),          # local mean rescaled by the shard count
    "moe": LocalImpl(("batch", "ep", "experts", "etp"), _moe),   # experts, etp: Partial out, the edge sums it
    "attn_gather": LocalImpl(("cp",), _attn_gather),   # context parallelism, all-gather K/V
    "attn_ring": LocalImpl(("cp",), _attn_ring),       # context parallelism, ring attention
}


def family(st: Strategy) -> str | None:
    """The local implementation family ``st`` needs (a strategy names at most one), or None."""
    return next((loc.split(":")[0] for loc in st.local if loc), None)


def local_collectives(node: fx.Node, st: Strategy, mesh_shape) -> list[LocalCollective]:
    """``(kind, bytes, axis, phase)`` of the collectives ``st``'s local implementation runs for
    ``node`` in one step (forward and backward), in the order it runs them per phase."""
    fam = family(st)
    if fam is None:
        return []
    roles: dict[str, list[int]] = {}
    for ax, loc in enumerate(st.local):
        if loc and mesh_shape[ax] > 1:
            roles.setdefault(loc.split(":")[1], []).append(ax)
    return LOCAL_IMPLS[fam].collectives(node, st, roles, tuple(mesh_shape))
