"""A torchtitan-style mixture-of-experts layer traces and trains on 4 ranks like one process.

The layer (written here, as torchtitan writes it): a linear router, top-k of its softmax, the tokens
counted per expert with ``histc`` and sorted by expert with ``argsort``, the routed rows scaled by
their scores, the experts run as ``torch._grouped_mm`` over the sorted rows (or ``bmm`` with each
row's expert weights gathered), and the outputs added back to their tokens (``index_add``). Its
experts stay whole on every rank (expert parallelism is for Hugging Face experts modules, docs/usage.md
"MoE"). fp32 ``torch._grouped_mm`` traces through frontend/grouped_mm.py. A layer whose experts loop
over ``counts.tolist()`` (data-dependent split sizes) is refused with a TraceError naming the layer.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from conftest import _fresh_call, _pool
from oracle import assert_same_training, make_batch, parallel_run, reference_run

RANK_LIMIT_S = 900     # 4 ranks each tracing and planning a MoE model on a shared 2-core machine
WORLD, STEPS, DIM, HIDDEN, EXPERTS, TOP_K = 4, 2, 32, 48, 4, 2


class TitanMoE(nn.Module):
    """Router top-k, histc + argsort permutation, experts, index_add back (torchtitan's MoE, no EP)."""

    def __init__(self, experts_op: str = "grouped_mm"):
        super().__init__()
        self.op = experts_op
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.w1 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * DIM ** -0.5)
        self.w3 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * DIM ** -0.5)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * HIDDEN ** -0.5)

    def experts(self, routed, ids, counts):
        if self.op == "grouped_mm":
            offs = torch.cumsum(counts, dim=0).to(torch.int32)
            h = F.silu(torch._grouped_mm(routed, self.w1, offs=offs)) * torch._grouped_mm(routed, self.w3, offs=offs)
            return torch._grouped_mm(h, self.w2, offs=offs)
        if self.op == "bmm":
            r = routed.unsqueeze(1)
            h = F.silu(torch.bmm(r, self.w1[ids])) * torch.bmm(r, self.w3[ids])
            return torch.bmm(h, self.w2[ids]).squeeze(1)
        outs = []   # "loop": torchtitan's for-loop experts, split sizes read from the counts
        for e, rows in enumerate(torch.split(routed, counts.long().tolist())):
            outs.append((F.silu(rows @ self.w1[e]) * (rows @ self.w3[e])) @ self.w2[e])
        return torch.cat(outs)

    def forward(self, x):
        scores = self.router(x).softmax(dim=-1)
        top_scores, top_idx = scores.topk(TOP_K, dim=-1)
        flat = top_idx.reshape(-1)
        counts = torch.histc(flat.float(), bins=EXPERTS, min=0, max=EXPERTS - 1)
        order = torch.argsort(flat, stable=True)
        rows = order // TOP_K
        routed = x[rows] * top_scores.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, rows, self.experts(routed, flat[order], counts))


class Net(nn.Module):
    def __init__(self, experts_op: str = "grouped_mm"):
        super().__init__()
        self.inp, self.moe, self.out = nn.Linear(DIM, DIM), TitanMoE(experts_op), nn.Linear(DIM, 10)

    def forward(self, x):
        h = self.inp(x)
        return self.out(h + self.moe(h))


def _batch():
    return make_batch("vector", 16, d_in=DIM)


def _job(rank, op, modes):
    x, y = _batch()
    return {mode: parallel_run(rank, lambda: Net(op), F.cross_entropy, x, y, autopar.Mesh(WORLD), mode,
                               steps=STEPS) for mode in modes}


def _check(op, modes):
    x, y = _batch()
    ref = reference_run(lambda: Net(op), F.cross_entropy, x, y, steps=STEPS)
    for r, res in enumerate(_pool(WORLD).run(_fresh_call, _job, op, modes, timeout_s=RANK_LIMIT_S)):
        for mode in modes:
            assert_same_training(ref, res[mode], what=f"torchtitan MoE ({op}) {mode} rank {r}")


def test_torchtitan_moe_with_grouped_mm_trains_like_one_process():
    _check("grouped_mm", ("data", "auto"))


@pytest.mark.slow
def test_torchtitan_moe_with_bmm_trains_like_one_process():
    _check("bmm", ("data", "auto"))


def test_grouped_mm_rewrite_equals_torch():
    from autopar.frontend.grouped_mm import gathered_grouped_mm

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(12, 8, generator=g), torch.randn(3, 8, 16, generator=g)
    offs = torch.tensor([3, 3, 10], dtype=torch.int32)      # an empty group; rows 10, 11 past the end
    got = gathered_grouped_mm(a, b, offs)
    want = torch._grouped_mm(a, b, offs=offs)
    torch.testing.assert_close(got[:10], want[:10], rtol=1e-6, atol=1e-6)
    assert torch.equal(got[10:], torch.zeros(2, 16))


def test_data_dependent_expert_loop_is_a_clear_error():
    x, y = _batch()
    with pytest.raises(autopar.TraceError,
                       match=r"(?s)could not trace the model in module .moe. \(File .*test_moe_titan.py.*line \d+.*\).*"
                             r"tolist.*fixed shapes.*torch.split\(x, counts.tolist\(\)\)"):
        autopar.plan(Net("loop"), autopar.Mesh(WORLD), example_inputs=(x,), loss_fn=F.cross_entropy,
                     example_target=y, mode="data")
