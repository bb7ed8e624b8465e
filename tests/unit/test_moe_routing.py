"""``sharding/moe_routing.py``: the expected copies per token of the de-duplicated expert dispatch (distinct
destination ranks, or nodes then ranks over two ep axes), uniform and group-limited routing, against a
Monte-Carlo count of routings drawn as the formula's model says."""
from __future__ import annotations

import pytest
import torch

from autopar.sharding.moe_routing import expected_distinct, hop_pieces

SAMPLES = 20000


def _draw(num_experts: int, k: int, n_group: int = 1, topk_group: int = 1, seed: int = 0) -> torch.Tensor:
    """[SAMPLES, k] expert ids: topk_group of n_group groups uniformly, then k distinct experts among theirs."""
    g = torch.Generator().manual_seed(seed)
    size = num_experts // n_group
    groups = torch.rand(SAMPLES, n_group, generator=g).argsort(1)[:, :topk_group]          # chosen groups
    pool = (groups.unsqueeze(2) * size + torch.arange(size)).reshape(SAMPLES, -1)          # their experts
    pick = torch.rand(pool.shape, generator=g).argsort(1)[:, :k]
    return pool.gather(1, pick)


def _count(ids: torch.Tensor, pieces: list[list[int]]) -> float:
    where = torch.empty(int(ids.max()) + 1, dtype=torch.int64)
    for i, members in enumerate(pieces):
        where[members] = i
    hit = torch.zeros(ids.shape[0], len(pieces), dtype=torch.bool).scatter_(1, where[ids], True)
    return hit.sum(1).double().mean().item()


@pytest.mark.parametrize("E,k,sizes,ep,groups", [
    (8, 2, [4], [True], (1, 1)),                       # Mixtral-like: 2 experts per rank
    (64, 6, [8], [True], (1, 1)),
    (32, 8, [16], [True], (8, 4)),                     # group-limited, a group over 2 ranks
    (32, 8, [4], [True], (8, 4)),                      # group-limited, a rank holding 2 groups
    (64, 8, [4, 4], [True, True], (4, 2)),             # two hops: nodes, then ranks in the node
    (32, 4, [2, 4], [True, False], (1, 1)),            # ep then an "experts" axis: pieces of 16
    (32, 4, [2, 4], [False, True], (1, 1)),            # experts axis outermost: the ep pieces interleave
])
def test_expected_copies_match_a_monte_carlo_count(E, k, sizes, ep, groups):
    ids = _draw(E, k, *groups)
    for pieces in hop_pieces(E, sizes, ep):
        want = _count(ids, pieces)
        got = expected_distinct(E, k, pieces, *groups)
        assert got == pytest.approx(want, abs=0.02), (pieces, got, want)


def test_deepseek_v3_copies_per_rank_and_node():
    """256 experts, top 8 in 4 of 8 groups, on ep 64 (4 experts a rank, a group = a node of 8 ranks):
    ~7.4 ranks per token, and at most 4 nodes."""
    E, k, ng, tg = 256, 8, 8, 4
    ranks = hop_pieces(E, [64], [True])[0]
    nodes, node_ranks = hop_pieces(E, [8, 8], [True, True])
    per_rank = expected_distinct(E, k, ranks, ng, tg)
    per_node = expected_distinct(E, k, nodes, ng, tg)
    assert 7.2 < per_rank < 7.5
    assert 3.5 < per_node <= 4.0
    assert expected_distinct(E, k, node_ranks, ng, tg) == pytest.approx(per_rank)
    ids = _draw(E, k, ng, tg, seed=1)
    assert per_node == pytest.approx(_count(ids, nodes), abs=0.02)
    assert per_rank == pytest.approx(_count(ids, ranks), abs=0.02)
    # uniform routing over all 256 experts: more ranks, and nodes are not bounded by 4
    assert expected_distinct(E, k, ranks) > per_rank and expected_distinct(E, k, nodes) > 4.5


def test_one_expert_per_rank_means_no_saving():
    """Mixtral 8x7B on ep 8: every expert on its own rank, so a token's k copies stay k."""
    assert expected_distinct(8, 2, hop_pieces(8, [8], [True])[0]) == pytest.approx(2.0)
