"""Candidate strategies on meshes of three or more axes: when the valid combinations outnumber the
limit, the ones that split the output on every axis are kept (``sharding/strategy.py``
``_combinations``). Llama 3's 128K layout (dp x cp x tp) lost the batch x sequence x heads view of
its queries to the cut, and the planner all-gathered them over dp in every layer."""
from __future__ import annotations

import torch
import torch.nn as nn

from autopar.frontend.trace import trace
from autopar.sharding.placements import Shard
from autopar.sharding.rules import axis_options
from autopar.sharding.strategy import mesh_strategies


class Heads(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(32, 32)

    def forward(self, x):
        b, s, _ = x.shape
        return self.q(x).view(b, s, 4, 8).transpose(1, 2)


def _view():
    x = torch.randn(4, 16, 32)
    traced = trace(Heads(), (x,), lambda out, y: (out * y).sum(), torch.randn(4, 4, 16, 8))
    return next(n for n in traced.gm.graph.nodes if n.op == "call_function" and "view" in str(n.target))


def test_the_batch_sequence_heads_split_of_a_view_survives_the_limit():
    view = _view()
    opts = axis_options(view)
    every = mesh_strategies(view, opts, (2, 2, 2), limit=10**6)
    kept = mesh_strategies(view, opts, (2, 2, 2))
    want = (Shard(0), Shard(1), Shard(2))
    assert len(every) > 64 and any(st.output == want for st in every)
    assert len(kept) == 64 and kept[0] == every[0]                    # replicate-everything first
    assert any(st.output == want for st in kept), [st.name for st in kept]
    full = [st for st in every if all(isinstance(p, Shard) for p in st.output)]
    assert sum(st in full for st in kept) >= min(len(full), 16)
    # fewer combinations than the limit: all of them, in product order, as before
    assert mesh_strategies(view, opts, (2, 2)) == mesh_strategies(view, opts, (2, 2), limit=10**6)
