"""Collective communication time: the alpha-beta model with ring / tree algorithms.

``n`` is the message size in bytes (for all_gather / reduce_scatter the *full*, gathered
size), ``p`` the group size, ``B`` the link bandwidth per direction, ``alpha`` its latency.

==============  =============================================
all_reduce      2(p-1)/p * n/B + 2(p-1) * alpha     (ring)
all_gather      (p-1)/p * n/B + (p-1) * alpha       (ring)
reduce_scatter  (p-1)/p * n/B + (p-1) * alpha       (ring)
all_to_all      (p-1)/p * n/B + (p-1) * alpha       (pairwise; across nodes split_all_to_all_time)
broadcast       ceil(log2 p) * (n/B + alpha)        (binomial tree)
reduce          ceil(log2 p) * (n/B + alpha)        (binomial tree)
send_recv       n/B + alpha                          (one hop)
==============  =============================================

A group of one device costs 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .devices import DeviceSpec, Link, axis_nodes


def _ring_all_reduce(n: float, p: int, link: Link) -> float:
    return 2 * (p - 1) / p * n / link.bandwidth + 2 * (p - 1) * link.latency


def _ring_half(n: float, p: int, link: Link) -> float:
    return (p - 1) / p * n / link.bandwidth + (p - 1) * link.latency


def _tree(n: float, p: int, link: Link) -> float:
    return math.ceil(math.log2(p)) * (n / link.bandwidth + link.latency)


def _send_recv(n: float, p: int, link: Link) -> float:
    return n / link.bandwidth + link.latency


_FORMULAS = {
    "all_reduce": _ring_all_reduce,
    "all_gather": _ring_half,
    "reduce_scatter": _ring_half,
    "all_to_all": _ring_half,
    "broadcast": _tree,
    "reduce": _tree,
    "send_recv": _send_recv,
}

COLLECTIVE_KINDS = tuple(_FORMULAS)


@dataclass(frozen=True)
class CommCost:
    """One collective: its kind, bytes (full size), group size and predicted seconds."""

    kind: str
    nbytes: float
    group_size: int
    time: float


def collective_time(kind: str, nbytes: float, group_size: int, link: Link) -> float:
    """Seconds for one collective over a flat group on one link (table in module doc)."""
    if kind not in _FORMULAS:
        raise ValueError(f"unknown collective {kind!r}; kinds: {', '.join(COLLECTIVE_KINDS)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if group_size == 1 or nbytes <= 0:
        return 0.0
    return _FORMULAS[kind](float(nbytes), int(group_size), link)


def collective_cost(kind: str, nbytes: float, group_size: int, link: Link) -> CommCost:
    """:func:`collective_time` as a :class:`CommCost`."""
    return CommCost(kind, float(nbytes), int(group_size), collective_time(kind, nbytes, group_size, link))


def hierarchical_all_reduce_time(nbytes: float, local: int, nodes: int, device: DeviceSpec) -> float:
    """All-reduce over ``local`` devices per node times ``nodes`` nodes, in three phases::

        reduce_scatter(n, local, intra) + all_reduce(n / local, nodes, inter)
                                        + all_gather(n, local, intra)
    """
    intra, inter = device.intra_node_link, device.inter_node_link
    return (
        collective_time("reduce_scatter", nbytes, local, intra)
        + collective_time("all_reduce", nbytes / local, nodes, inter)
        + collective_time("all_gather", nbytes, local, intra)
    )


def axis_collective_time(kind: str, nbytes: float, device: DeviceSpec, axis_size: int, inner_size: int = 1) -> float:
    """A collective over one mesh axis (stride ``inner_size``, see ``devices.axis_nodes``).

    An axis inside one node uses the intra-node link. An axis spanning nodes runs flat over
    the inter-node link, except all_reduce, which takes the cheaper of the flat ring and
    :func:`hierarchical_all_reduce_time` (``local = axis_size / nodes`` devices per node), and
    all_to_all, whose node-local pieces travel over the intra-node link (:func:`split_all_to_all_time`).
    """
    nodes = axis_nodes(device, axis_size, inner_size)
    if nodes <= 1:
        return collective_time(kind, nbytes, axis_size, device.intra_node_link)
    flat = collective_time(kind, nbytes, axis_size, device.inter_node_link)
    local = axis_size // nodes
    if kind == "all_to_all" and local > 1:
        return min(flat, split_all_to_all_time(nbytes, axis_size, local, device))
    if kind != "all_reduce" or local <= 1:
        return flat
    return min(flat, hierarchical_all_reduce_time(nbytes, local, nodes, device))


def split_all_to_all_time(nbytes: float, p: int, local: int, device: DeviceSpec) -> float:
    """Pairwise all-to-all over ``p`` ranks, ``local`` per node: each rank's ``n / p`` pieces go to its
    ``local - 1`` node peers over the intra-node link and to the ``p - local`` others over the
    inter-node link, both at once::

        max((local-1)/p * n/B_intra + (local-1) alpha_intra,  (p-local)/p * n/B_inter + (p-local) alpha_inter)
    """
    intra, inter = device.intra_node_link, device.inter_node_link
    return max((local - 1) / p * nbytes / intra.bandwidth + (local - 1) * intra.latency,
               (p - local) / p * nbytes / inter.bandwidth + (p - local) * inter.latency)


GRAD_BUCKET_BYTES = 25 * 2**20     # DDP's bucket_cap_mb default, used by runtime.grad_sync and runtime.zero


def bucketed_collective_time(kind: str, nbytes: float, device: DeviceSpec, axis_size: int,
                             inner_size: int = 1, bucket: float = GRAD_BUCKET_BYTES) -> float:
    """One tensor's share of a ``kind`` collective that runs in buckets of ``bucket`` bytes: its
    bandwidth time plus its share of one launch latency (``nbytes / bucket``, at most one)."""
    if nbytes <= 0:
        return 0.0
    lat = axis_collective_time(kind, 1.0, device, axis_size, inner_size)
    full = axis_collective_time(kind, nbytes, device, axis_size, inner_size)
    return full - lat + lat * min(1.0, nbytes / bucket)

