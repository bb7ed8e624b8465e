"""The embedding and the head as pipeline cut units of their own (``graph.cut_points``, ``ends=True``;
``solver/end_units.py``): L layers give L + 2 units, v = (L + 2) / pp is offered, the DP keeps the
ends with their layers unless an interleaved schedule needs more model stages than layers, and
an end is a unit only where it is worth a cut."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.frontend.trace import trace
from autopar.graph.cut_points import EMBEDDING, HEAD, assign_units, crossing_values, end_cuts
from autopar.solver.end_units import rules_at
from autopar.solver.inter_op import CutRules, LayerProfile, partition_stages
from autopar.solver.virtual_stages import virtual_stage_choices
from examples.models import GPT, Llama, lm_loss
from oracle import make_batch
from test_virtual_stages import _plan      # a GPT on two pipeline stages, planned under a context

X, Y = make_batch("tokens", 8)


@pytest.mark.parametrize("make", [lambda n: GPT(qkv_bias=False, layers=n, hidden=32),
                                  lambda n: Llama(hidden=32, layers=n, ffn=64)], ids=["gpt", "llama"])
def test_l_layers_are_l_plus_two_units_and_v_of_l_plus_two_over_pp_is_offered(make):
    traced = trace(make(6), (X,), lm_loss, Y)
    plain, _ = assign_units(traced.gm)
    units, unit_of = assign_units(traced.gm, ends=True)
    assert len(plain) == 6 and len(units) == 8
    assert [u.name for u in units] == [EMBEDDING] + [u.name for u in plain] + [HEAD]
    assert end_cuts(units) == (1, 7) and end_cuts(plain) == ()
    assert [u.is_layer for u in units] == [False] + [True] * 6 + [False]
    by_name = {n.name: n for n in traced.gm.graph.nodes}
    embedding = [by_name[n].target for n in units[0].nodes]
    assert torch.ops.aten.embedding.default in embedding or any("embedding" in str(t) for t in embedding)
    assert any("cross_entropy" in str(by_name[n].target) for n in units[-1].nodes)
    # every op in one unit, every value flows forward: a valid cut at each unit boundary
    assert sorted(n for u in units for n in u.nodes) == sorted(unit_of)
    for node in traced.gm.graph.nodes:
        if node.name in unit_of:
            assert all(unit_of.get(u.name, 7) >= unit_of[node.name] for u in node.users if u.op != "output")
    # what crosses an end cut is the hidden state, as between two layers
    widths = [sum(v.meta["val"].numel() for v in vals) for vals in crossing_values(traced.gm, unit_of, 8)]
    assert widths[1] <= max(widths[2:7]) and widths[7] <= max(widths[2:7])
    assert 4 in virtual_stage_choices(2, 4, len(units)) and 4 not in virtual_stage_choices(2, 4, len(plain))


def test_the_dp_keeps_the_ends_joined_unless_the_model_stages_outnumber_the_layers():
    """``CutRules.joined``: a partition over L + 2 units with the end cuts joined is the one over the
    L layer units with each end summed into its layer; ``rules_at`` frees them only for an
    interleaved pp x v over L."""
    mid = [LayerProfile(f"l{i}", 1.0 + 0.1 * i, 2.0, 4.0, 1.0, 0.5) for i in range(6)]
    ends = [LayerProfile("e", 0.3, 0.6, 9.0, 0.5, 0.5)] + mid + [LayerProfile("h", 0.8, 1.6, 9.0, 2.0, 0.0)]
    merged = [LayerProfile("l0", 1.3, 2.6, 13.0, 1.5, 0.5)] + mid[1:5] + [LayerProfile("l5", 2.3, 3.6, 13.0, 3.0, 0.0)]
    joined = CutRules(joined=(1, 7))
    for schedule, v in (("1f1b", None), ("gpipe", None), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3)):
        pp = 2
        rules = rules_at(joined, schedule, pp, v, len(ends))
        assert rules.joined == (1, 7)
        got = partition_stages(ends, pp, 6, schedule, rules=rules, virtual_stages=v)
        want = partition_stages(merged, pp, 6, schedule, virtual_stages=v)
        assert [b + 1 for b in want.boundaries] == got.boundaries
        assert got.step_time == pytest.approx(want.step_time)
    free = rules_at(joined, "interleaved_1f1b", 2, 4, len(ends))
    assert free.joined == ()
    part = partition_stages(ends, 2, 8, "interleaved_1f1b", rules=free, virtual_stages=4)
    assert part.boundaries == list(range(1, 8))
    with pytest.raises(ValueError, match="cannot split 6 layers into 8 stages"):
        partition_stages(ends, 2, 8, "interleaved_1f1b", rules=joined, virtual_stages=4)


def test_a_plan_at_v_of_l_plus_two_over_pp_puts_the_ends_in_chunks_of_their_own():
    plan = _plan(2, virtual_stages=2, microbatches=4)
    assert plan.pipeline.virtual_stages == 2
    assert [s.layers for s in plan.stages] == [[EMBEDDING], ["blocks.0"], ["blocks.1"], [HEAD]]
    assert [s.ranks for s in plan.stages] == [[0], [1], [0], [1]]
    assert "<embedding>" in plan.report()
    with pytest.raises(autopar.PlanError, match=r"virtual_stages=4 on 2 pipeline ranks needs 8 model stages, but the "
                       r"traced model has only 4 layers to cut between \(2 repeated layers and 2 end unit\(s\): the "
                       r"embedding, the head\) \(every stage needs one\); use virtual_stages <= 2"):
        _plan(2, virtual_stages=4, microbatches=4)


class _Ends(nn.Module):
    """Before its layers: a parameterless op, or a linear whose output is 4x the hidden state;
    after them a parameterless sum."""

    def __init__(self, wide: bool):
        super().__init__()
        self.wide = wide
        self.up = nn.Linear(8, 32)
        self.blocks = nn.ModuleList([nn.Linear(32 if wide else 8, 8), nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x):
        h = self.up(x) if self.wide else x * 2.0
        for b in self.blocks:
            h = b(h)
        return h.sum()


@pytest.mark.parametrize("wide", [False, True])
def test_an_end_is_a_unit_only_where_it_is_worth_a_cut(wide):
    """No unit for ops outside the layers that use no parameter (nothing to train there), nor for
    ones whose cut would carry more than the widest cut between layers."""
    traced = trace(_Ends(wide), (torch.randn(4, 8),))
    units, _ = assign_units(traced.gm, ends=True)
    assert [u.name for u in units] == ["blocks.0", "blocks.1", "blocks.2"]
