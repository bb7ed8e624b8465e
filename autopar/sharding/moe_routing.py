"""How many copies of a token the de-duplicated expert dispatch sends (``collectives/moe_dispatch.py``).

The runtime sends a token ONCE to each rank holding one of its k experts (with its k expert ids and
weights); that rank sums its experts' weighted outputs for the token before the combine sends ONE row
back. Over several ep axes (mesh order, a hop each) the copy that reached a coordinate is sent on once
per distinct next coordinate among its experts there: hop i moves, per token, one copy per distinct tuple
of the token's experts' digits on ep axes 1..i (``D_i``). With the ep dim split as (node axis, in-node
axis) this is DeepSeek-V3's / DeepEP's two-hop form: one copy per destination node across nodes, then
the fan-out inside the node.

Expected ``D_i`` for a set partition of the E experts into pieces (each piece: the experts sharing one
digit tuple; ``m = |S|``), the k experts of a token a uniform k-subset (no expert twice)::

    uniform routing        P(S hit) = 1 - C(E - m, k) / C(E, k)                D = sum_S P(S hit)

**Group-limited routing** (DeepSeek-V3's ``n_group`` / ``topk_group``: E experts in ``n_group`` groups of
consecutive ids; each token keeps its ``topk_group`` best groups, then its k best experts inside them),
modelled as ``topk_group`` groups uniformly, then a uniform k-subset of their ``M = topk_group E / n_group``
experts. With ``j = |S ∩ chosen groups|``::

    P(S missed) = sum_j P(j) C(M - j, k) / C(M, k)

where ``P(j)`` counts the ways to choose ``topk_group`` of the groups whose overlaps with S sum to j (a DP
over the groups) over C(n_group, topk_group). A token then meets at most ``topk_group`` groups: with one
group per node (DeepSeek-V3's 256 experts on ep 64 in 8 nodes), at most ``topk_group`` = 4 nodes.
``tests/unit/test_moe_routing.py`` checks both against a Monte-Carlo count.

Each copy is sent over the axis like any all-to-all piece: a uniform destination, so the node-local
share of the bytes is the axis's in-node fraction (``comm.split_all_to_all_time`` splits the time into
in-node and cross-node parts by the mesh's node size).
"""
from __future__ import annotations

import math
from functools import lru_cache


def expert_digits(num_experts: int, sizes: list[int]) -> list[tuple]:
    """Per expert, its coordinates on the expert-splitting axes ``sizes`` (mesh order, first outermost, as
    parameters are sharded; ``collectives/moe_dispatch.moe_experts``)."""
    pieces = math.prod(sizes)
    n_local = num_experts // pieces
    strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
    return [tuple((e // (n_local * st)) % s for s, st in zip(sizes, strides)) for e in range(num_experts)]


def hop_pieces(num_experts: int, sizes: list[int], ep: list[bool]) -> list[list[list[int]]]:
    """Per ep hop (the axes where ``ep`` is True, in order), the experts grouped by their digits on the ep
    axes up to and including that hop."""
    digits = expert_digits(num_experts, sizes)
    out, seen = [], []
    for a, is_ep in enumerate(ep):
        if not is_ep:
            continue
        seen.append(a)
        groups: dict[tuple, list[int]] = {}
        for e, d in enumerate(digits):
            groups.setdefault(tuple(d[i] for i in seen), []).append(e)
        out.append(list(groups.values()))
    return out


@lru_cache(maxsize=4096)
def _miss_grouped(k: int, group_size: int, topk_group: int, overlaps: tuple) -> float:
    n_group = len(overlaps)
    m_all = topk_group * group_size
    dp = {(0, 0): 1}                                 # (groups chosen, overlap sum) -> ways
    for o in overlaps:
        nxt = dict(dp)
        for (t, j), ways in dp.items():
            if t < topk_group:
                nxt[(t + 1, j + o)] = nxt.get((t + 1, j + o), 0) + ways
        dp = nxt
    total = math.comb(n_group, topk_group)
    return sum(w * math.comb(m_all - j, k) for (t, j), w in dp.items() if t == topk_group) / total / math.comb(m_all, k)


def expected_distinct(num_experts: int, k: int, pieces: list[list[int]], n_group: int = 1,
                      topk_group: int = 1) -> float:
    """E[number of ``pieces`` a token's k experts fall in] (module docstring); group-limited when
    ``1 < topk_group < n_group`` and the groups can hold k experts, uniform otherwise."""
    k = min(k, num_experts)
    grouped = (1 <= topk_group < n_group and num_experts % n_group == 0
               and topk_group * num_experts // n_group >= k)
    out = 0.0
    for s in pieces:
        if grouped:
            size = num_experts // n_group
            counts = [0] * n_group
            for e in s:
                counts[e // size] += 1
            out += 1.0 - _miss_grouped(k, size, topk_group, tuple(sorted(counts)))
        else:
            out += 1.0 - math.comb(num_experts - len(s), k) / math.comb(num_experts, k)
    return out


def routing_groups(key: str) -> tuple[int, int]:
    """(n_group, topk_group) of the router feeding experts entry ``key`` when its model routes group-limited
    (the experts module's config has ``n_group`` > 1 and ``topk_group`` < ``n_group``); else (1, 1)."""
    from autopar.frontend.moe_experts import registered

    e = registered(key)
    cfg = getattr(getattr(e, "template", None), "config", None)
    n, t = getattr(cfg, "n_group", None), getattr(cfg, "topk_group", None)
    if isinstance(n, int) and isinstance(t, int) and 1 <= t < n:
        return n, t
    return 1, 1


def copies_per_token(key: str, num_experts: int, k: int, sizes: list[int], ep: list[bool]) -> list[float]:
    """Expected copies of one token each ep hop sends (``D_i``), for experts entry ``key`` split over
    axes ``sizes`` (mesh order; ``ep[a]``: axis a dispatches, else it is an "experts" axis)."""
    n_group, topk_group = routing_groups(key)
    return [expected_distinct(num_experts, k, p, n_group, topk_group) for p in hop_pieces(num_experts, sizes, ep)]
