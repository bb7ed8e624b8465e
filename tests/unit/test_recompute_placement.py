"""Which layers an interleaved pipeline recomputes (``solver/recompute_placement.py``): each rank its
``k`` layers where the in-flight microbatches make their stored activations weigh most."""
from __future__ import annotations

from autopar.graph.recompute_layers import spread
from autopar.solver.interleaved_memory import rank_charges
from autopar.solver.recompute_placement import charged_layers

NAMES = [f"layers.{i}" for i in range(126)]       # Llama 3 405B on pp 16, v 4, 32 microbatches
PP, V, M, KIND = 16, 4, 32, "interleaved_1f1b"


def _kept_weight(choice: dict) -> list[int]:
    """Per rank: the microbatch-layers of activations it stores at its peak (charge x layers kept)."""
    charges = rank_charges(KIND, PP, M, V)
    stages = PP * V
    out = [0] * PP
    for i, n in enumerate(NAMES):
        s = i * stages // len(NAMES)
        if n not in choice:
            out[s % PP] += charges[s]
    return out


def test_each_rank_recomputes_its_heaviest_stages_first():
    for k in range(0, 9):
        choice = charged_layers(NAMES, k, PP, M, KIND, V)
        assert list(choice) == [n for n in NAMES if n in choice]                     # graph order
        per_rank = [0] * PP
        for i, n in enumerate(NAMES):
            if n in choice:
                per_rank[(i * PP * V // len(NAMES)) % PP] += 1
        assert all(c == min(k, sum(1 for i in range(126) if (i * 64 // 126) % PP == r)) for r, c in enumerate(per_rank))
    # 4 per rank (64 layers): the fullest rank stores less than with 64 layers spread evenly, and less
    # than spread's 5 per rank (80 layers) stores, which is what fitted before
    charged, even = charged_layers(NAMES, 4, PP, M, KIND, V), spread(NAMES, 64)
    assert len(charged) == len(even) == 64
    assert max(_kept_weight(charged)) < max(_kept_weight(even))
    assert max(_kept_weight(charged)) <= max(_kept_weight(spread(NAMES, 80)))


def test_one_stage_per_rank_counts_alike():
    names = NAMES[:32]
    choice = charged_layers(names, 1, 4, 8, "1f1b")
    assert len(choice) == 4
    assert all(sum(f"layers.{i}" in choice for i in range(8 * r, 8 * r + 8)) == 1 for r in range(4))
