"""``collectives/moe_dispatch.py`` alone, on 2 ranks: every strategy of the ``autopar::moe_experts``
rule run on local pieces gives the single-device module's output and gradients (hidden, routing
weights, expert parameters), with routing that sends every token to the experts of one rank (the
other receives nothing) and with random routing; and the all_to_alls it runs are the ones
``sharding/local_impls.py`` lists (kinds, axes and phases per rank, bytes summed over the ranks)."""
from __future__ import annotations

from collections import Counter
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import autopar
from autopar.collectives import comm, local_ops
from autopar.collectives.groups import axis_groups, bound_axes
from autopar.frontend.trace import trace
from autopar.sharding.candidates import build_candidates
from autopar.sharding import local_impls
from autopar.sharding.local_impls import local_collectives
from autopar.sharding.moe_routing import hop_pieces
from autopar.sharding.placements import Replicate, Shard
from autopar.sharding.shard_params import local_piece
from conftest import run_ranks

pytest.importorskip("transformers")

T, H, E, K = 8, 16, 4, 2


class Block(nn.Module):
    """A Mixtral experts module whose hidden rows and routing weights need gradients."""

    def __init__(self):
        super().__init__()
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts

        cfg = MixtralConfig(hidden_size=H, intermediate_size=24, num_local_experts=E, num_experts_per_tok=K)
        cfg._experts_implementation = "grouped_mm"
        self.experts = MixtralExperts(cfg)
        self.pre = nn.Linear(H, H)
        self.temperature = nn.Parameter(torch.ones(()))
        with torch.no_grad():
            for p in self.experts.parameters():
                p.normal_(0, 0.3)

    def forward(self, x, index, weights):
        return self.experts(self.pre(x), index, weights * self.temperature)


def _inputs(routing: str):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(T, H, generator=g)
    if routing == "one_rank":        # experts 0 and 1 only: all on rank 0 when the experts split 2 ways
        index = torch.tensor([[0, 1], [1, 0]] * (T // 2))
    else:
        index = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g)
    seed = torch.randn(T, H, generator=g)       # the output's gradient
    return hidden, index, weights, seed


def _reference(block, hidden, index, weights, seed):
    h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
    out = block.experts(h, index, w)
    (out * seed).sum().backward()
    return out.detach(), {"hidden": h.grad, "weights": w.grad,
                          **{n: p.grad for n, p in block.experts.named_parameters()}}


def observed_copies(index):
    """``moe_routing.copies_per_token`` as this routing has it: per hop, the mean count of distinct
    destinations among each local token's experts (what the de-duplicated dispatch sends)."""
    def copies(key, num_experts, k, sizes, ep):
        out = []
        for pieces in hop_pieces(num_experts, sizes, ep):
            where = {e: i for i, members in enumerate(pieces) for e in members}
            out.append(sum(len({where[int(e)] for e in row}) for row in index) / max(1, len(index)))
        return out
    return copies


def _job(rank, routing, shape=(2,), names=("a",)):
    torch.manual_seed(0)
    block = Block()
    hidden, index, weights, seed = _inputs(routing)
    want_out, want_grads = _reference(block, hidden, index, weights, seed)
    mesh = autopar.Mesh(shape, axis_names=names)
    coords = mesh.coords(rank)
    groups = axis_groups(mesh)
    gm = trace(block, (hidden, index, weights)).gm
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.autopar.moe_experts.default)
    inputs = ["hidden", "index", "weights", *(n for n, _ in block.experts.named_parameters())]
    full = [hidden, index, weights, *block.experts.parameters()]
    checked = {}
    with bound_axes(groups):
        for st in build_candidates(gm, mesh.shape).strategies[node.name]:
            local = [local_piece(t.detach(), spec, coords, mesh.shape) for t, spec in zip(full, st.inputs)]
            local = [t.requires_grad_() if t.is_floating_point() else t for t in local]
            roles: dict[str, list[str]] = {}
            for ax, loc in enumerate(st.local):
                if loc:
                    roles.setdefault(loc.split(":")[1], []).append(names[ax])
            with comm.count_collectives() as counter:
                out = local_ops.IMPLS["moe"](node.args[0], local[0], local[1], local[2], local[3:],
                                             _op="moe_experts", _axes=roles)
                (out * local_piece(seed, st.output, coords, mesh.shape)).sum().backward()
            got = out.detach().clone()
            for ax, p in enumerate(st.output):
                if not isinstance(p, (Shard, Replicate)):          # Partial: summed over the axis
                    dist.all_reduce(got, group=groups[names[ax]].group)
            torch.testing.assert_close(got, local_piece(want_out, st.output, coords, mesh.shape), rtol=1e-5,
                                       atol=1e-6, msg=f"{st.name} output")
            for name, t, spec in zip(inputs, local, st.inputs):
                if not t.is_floating_point():
                    continue
                grad = t.grad if t.grad is not None else torch.zeros_like(t)
                for ax, (p, o) in enumerate(zip(spec, st.output)):
                    if isinstance(p, Replicate) and not isinstance(o, Replicate):   # whole input, split work
                        dist.all_reduce(grad, group=groups[names[ax]].group)        # partial gradients
                torch.testing.assert_close(grad, local_piece(want_grads[name], spec, coords, mesh.shape),
                                           rtol=1e-5, atol=1e-6, msg=f"{st.name} gradient of {name}")
            with mock.patch.object(local_impls, "dispatch_copies", observed_copies(local[1])):
                listed = local_collectives(node, st, mesh.shape)     # at this routing's copies, not the expectation
            expect = [(k, b, names[ax], ph) for k, b, ax, ph in listed]
            checked[st.name] = ([(k, a, ph) for k, _, a, ph in counter.calls], sum(b for _, b, _, _ in counter.calls),
                                [(k, a, ph) for k, _, a, ph in expect], sum(b for _, b, _, _ in expect))
    return checked


def _check_counts(results):
    for name in results[0]:
        ran = [r[name] for r in results]
        for kinds, _, want_kinds, _ in ran:
            assert Counter(kinds) == Counter(want_kinds), f"{name}: ran {kinds}, local_impls lists {want_kinds}"
        assert sum(r[1] for r in ran) == sum(r[3] for r in ran), \
            f"{name}: {sum(r[1] for r in ran)} bytes ran over the ranks, local_impls lists {sum(r[3] for r in ran)}"


@pytest.mark.parametrize("routing", ["one_rank", pytest.param("random", marks=pytest.mark.slow)])
def test_every_strategy_matches_one_device(routing):
    results = run_ranks(2, _job, routing, timeout_s=600)
    assert set(results[0]) == {"replicate", "batch", "ep", "experts", "etp"}, set(results[0])
    _check_counts(results)
    assert results[0]["ep"][0], "ep must run all_to_alls"
    if routing == "one_rank":       # both experts of every token on rank 0: one copy per token, not k
        h_row = (H + K) * 4
        assert sum(r["ep"][1] for r in results) == T * (h_row + 4 * K + H * 4 + H * 4 + h_row) + 2 * 2 * 8


@pytest.mark.slow
def test_every_strategy_pair_on_a_2x2_mesh_matches_one_device():
    """Two split axes compose: ep on both (two hops), ep with experts, ep with batch, and so on."""
    results = run_ranks(4, _job, "random", (2, 2), ("a", "b"), timeout_s=600)
    assert {"ep×ep", "ep×experts", "experts×ep", "batch×ep", "experts×experts"} <= set(results[0]), set(results[0])
    _check_counts(results)
