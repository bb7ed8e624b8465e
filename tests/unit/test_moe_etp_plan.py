"""Planning expert tensor parallelism (``sharding/rules/moe.py``'s "etp"): the placements per experts
layout, the fused gate/up weights stored block-split (``graph/moe_chunk_hints.py``), AUTO folding ep
with etp, and a request the experts cannot take. Planning only: no processes."""
from __future__ import annotations

import copy
import dataclasses

import pytest

import autopar
from autopar.cost_models.moe import is_moe
from autopar.frontend.moe_experts import registered
from autopar.frontend.trace import trace
from autopar.sharding.placements import P, Shard
from autopar.sharding.rules.moe import etp_placements
from moe_models import batch, lm_loss, moe_lm
from unit.test_moe_plan import _mixtral, _moe_nodes, _plan



def _entry(family):
    x, y = batch()
    traced = trace(moe_lm(family), (x,), lm_loss, y)
    return registered(next(n for n in traced.gm.graph.nodes if is_moe(n)).args[0])


def test_etp_placements_follow_each_experts_layout():
    mixtral = _entry("mixtral")          # gate_up [E, 2F, H] = [gate; up], down [E, H, F]
    assert mixtral.param_names == ("gate_up_proj", "down_proj")
    assert etp_placements(mixtral) == (Shard(1, 2), Shard(2))
    gpt_oss = _entry("gpt_oss")          # transposed, gate/up interleaved, biases
    assert gpt_oss.param_names == ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    assert etp_placements(gpt_oss) == (Shard(2), Shard(1), Shard(1), P)
    no_gate = dataclasses.replace(mixtral, param_names=("up_proj", "down_proj"), has_gate=False)
    assert etp_placements(no_gate) == (Shard(1), Shard(2))
    assert etp_placements(dataclasses.replace(mixtral, param_names=("gate_up_proj", "scale"))) is None
    normed = copy.copy(mixtral.template)
    normed.has_post_expert_norm = True
    assert etp_placements(dataclasses.replace(mixtral, template=normed)) is None


def test_auto_folds_ep_with_etp_and_stores_fused_weights_block_split():
    """Two large experts on an ep x tp mesh: ep takes the experts, etp splits each expert's FFN on tp
    (Megatron-Core's parallel folding); [gate; up] is stored block-split, so nothing gathers it."""
    mesh = autopar.Mesh((2, 2), axis_names=("ep", "tp"), device="h100")
    plan = _plan(mesh, mode="auto", model=_mixtral(512, 4096, experts=2, layers=1), rows=16, time_budget=10)
    moe = _moe_nodes(plan)
    assert {d.strategy for d in moe.values()} == {"ep×etp"}, {d.strategy for d in moe.values()}
    assert plan.degrees["ep"] == 2 and plan.degrees["tp"] == 2, plan.degrees
    experts = {n.rsplit(".", 1)[1]: p.spec for n, p in plan.params.items() if ".experts." in n}
    assert experts == {"gate_up_proj": (Shard(0), Shard(1, 2)), "down_proj": (Shard(0), Shard(2))}, experts
    mine = [c for c in plan.collective_list if c.node in moe]
    assert not [c for c in mine if c.kind == "all_gather" and c.axes == ["tp"]], mine
    assert {c.axes[0] for c in mine if c.kind == "all_to_all"} == {"ep"}
    # the Partial output is summed on tp forward; the hidden rows' gradient backward
    assert any(c.kind == "all_reduce" and c.axes == ["tp"] and c.phase == "fwd" for c in plan.collective_list)
    assert any(c.kind == "all_reduce" and c.axes == ["tp"] and c.phase == "bwd" for c in mine)


def test_etp_on_experts_whose_ffn_does_not_divide_is_refused():
    model = _mixtral(64, 31, experts=4, layers=1)        # intermediate 31 does not split 2 ways
    autopar.op_strategy("*experts", tp="etp")
    with pytest.raises(ValueError, match=r"op_strategy\('\*experts', tp='etp'\) matches no op with such a strategy"):
        _plan(autopar.Mesh(2, axis_names=("tp",), device="cpu"), model=model)
