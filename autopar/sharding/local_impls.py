"""Local implementations: ops whose sharded form needs more than the op on local pieces.

A rule marks such a strategy with ``AxisStrategy.local = "family:role"`` on the mesh axes it
splits (``"loss:vocab"``, ``"batch_norm:sync"``, ...); ``passes/insert_collectives`` replaces
the op with ``collectives/local_ops.py``'s implementation of the family, handing it
``{role: [axis names]}``. This module is the one description of the collectives each family
runs: ``solver/decode.py`` lists them in the plan, ``solver/problem.py`` costs them (the sum
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
    """``collectives/moe_dispatch.py``: per ep axis in mesh order, forward, an all_to_all of the
    per-expert row counts (E int64s) and one of the rows (hidden row and routing weight side by side:
    ``T_local * k`` rows whatever the routing, on the first ep axis; on a further one the same count
    for balanced routing), or two (hidden, then weights) when their dtypes differ; then, in reverse
    axis order, the results back (``rows x H``). Backward, when the node needs a gradient, each
    data all_to_all reversed: the results' in axis order, then the rows' in reverse order."""
    ep = roles.get("ep", [])
    if not ep:
        return []
    hidden, index, weights = tensor_inputs(node)[:3]
    h, idx, w = (a.meta["val"] for a in (hidden, index, weights))
    rows = idx.numel() / shard_factor(st.inputs[1], mesh_shape)
    width = h.shape[-1]
    num_experts = tensor_inputs(node)[3].meta["val"].shape[0]
    if w.dtype == h.dtype:
        sends = [rows * (width + 1) * h.element_size()]
    else:
        sends = [rows * width * h.element_size(), rows * w.element_size()]
    back = rows * width * h.element_size()
    fwd = [c for ax in ep for c in [("all_to_all", 8.0 * num_experts, ax, "fwd")]
           + [("all_to_all", b, ax, "fwd") for b in sends]]
    fwd += [("all_to_all", back, ax, "fwd") for ax in reversed(ep)]
    if node not in grad_nodes(node.graph):
        return fwd
    bwd = [("all_to_all", back, ax, "bwd") for ax in ep]
    if hidden in grad_nodes(node.graph) or weights in grad_nodes(node.graph):
        bwd += [("all_to_all", b, ax, "bwd") for ax in reversed(ep) for b in reversed(sends)]
    return fwd + bwd


def _none(node, st, roles, mesh_shape) -> list[LocalCollective]:
    return []


LOCAL_IMPLS: dict[str, LocalImpl] = {
    "loss": LocalImpl(("batch", "vocab"), _loss),
    "batch_norm": LocalImpl(("sync",), _batch_norm),
    "embedding": LocalImpl(("vocab",), _none),     # masked lookup, Partial out: the edge sums it
    "mean": LocalImpl(("scale",), _none),          # local mean rescaled by the shard count
    "moe": LocalImpl(("batch", "ep", "experts"), _moe),   # experts: Partial out, the edge sums it
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
