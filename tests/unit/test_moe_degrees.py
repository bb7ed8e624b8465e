"""plan.degrees' "ep" and "cp" keys (solver/degrees.py, plan/degree_keys.py), their JSON compatibility
and reports, and the cost pieces of expert parallelism that need no MoE model: the all-to-all across
nodes, the H800 preset and the ``moe_imbalance`` context key. Planning only, no processes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import autopar
from autopar.cost_models.comm import axis_collective_time, collective_time
from autopar.cost_models.devices import get_device
from autopar.plan.degree_keys import degrees_text, full_degrees
from autopar.plan.plan import Alternative, NodeDecision
from autopar.sharding.placements import Replicate
from autopar.solver.degrees import degrees_of, split_axes_of
from autopar.solver.progress import _describe

DATA = Path(__file__).parent.parent / "data"


def _node(op, strategy, local):
    return NodeDecision(op=op, strategy=strategy, inputs=[], output=(Replicate(), Replicate()), local=local)


def test_ep_and_cp_degrees_come_from_the_node_strategies():
    nodes = {"moe": _node("autopar.moe_experts.default", "ep×batch", ["moe:ep", "moe:batch"]),
             "attn": _node("aten.scaled_dot_product_attention.default", "batch×cp", [None, None]),
             "mm": _node("aten.mm.default", "cp×cp", [None, None])}        # not attention: no cp
    assert split_axes_of(nodes, (4, 2)) == {"ep": {0}, "cp": {1}}
    d = degrees_of({"a": "dp", "b": "dp"}, ("a", "b"), (4, 2), nodes)
    assert d == {"dp": 8, "tp": 1, "pp": 1, "ep": 4, "cp": 2}
    # "experts" (tokens whole, experts split) counts as ep too; axes of size 1 do not
    nodes["moe"] = _node("autopar.moe_experts.default", "experts×ep", ["moe:experts", "moe:ep"])
    assert degrees_of({"a": "tp", "b": "dp"}, ("a", "b"), (2, 1), nodes)["ep"] == 2
    assert degrees_of({"a": "dp"}, ("a",), (4,), {})["ep"] == 1


def test_plan_without_moe_has_every_degree_key():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    plan = autopar.plan(model, autopar.Mesh(2), example_inputs=(torch.randn(8, 8),), mode="data")
    assert plan.degrees == {"dp": 2, "tp": 1, "pp": 1, "ep": 1, "cp": 1}
    assert "ep=" not in plan.report() and "degrees: dp=2 tp=1 pp=1" in plan.report()
    assert autopar.Plan.from_json(plan.to_json()) == plan


def test_old_plan_json_without_ep_cp_reads_them_as_1():
    raw = json.loads((DATA / "plan_v0_data_mesh2.json").read_text())
    assert "ep" not in raw["degrees"]
    plan = autopar.Plan.from_dict(raw)
    assert plan.degrees["ep"] == 1 and plan.degrees["cp"] == 1
    assert all(a.degrees["ep"] == 1 for a in plan.alternatives)
    assert autopar.Plan.from_json(plan.to_json()) == plan


def test_reports_show_ep_and_cp_only_above_1():
    d = full_degrees({"dp": 4, "tp": 1, "pp": 1, "ep": 4})
    assert list(d) == ["dp", "tp", "pp", "ep", "cp"] and d["cp"] == 1
    assert degrees_text(d) == "dp=4 tp=1 pp=1 ep=4"
    assert degrees_text({"dp": 2, "tp": 2, "pp": 1, "cp": 2}) == "dp=2 tp=2 pp=1 cp=2"
    assert Alternative({"dp": 2}, 1.0, 0.0, True).degrees == {"dp": 2, "tp": 1, "pp": 1, "ep": 1, "cp": 1}
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    plan = autopar.plan(model, autopar.Mesh(2), example_inputs=(torch.randn(8, 8),), mode="data")
    plan.degrees = {**plan.degrees, "ep": 2}
    assert "degrees: dp=2 tp=1 pp=1 ep=2" in plan.report()
    assert _describe(plan).startswith("dp=2 tp=1 pp=1 ep=2")


def test_all_to_all_across_nodes_sends_node_local_pieces_over_nvlink():
    h100 = get_device("h100")
    n, p = 64 * 2**20, 16                        # two nodes of 8
    flat = collective_time("all_to_all", n, p, h100.inter_node_link)
    split = axis_collective_time("all_to_all", n, h100, p)
    # 8 of 16 pieces cross nodes at 50 GB/s; the 7 node-local ones go over NVLink at the same time
    assert split == pytest.approx(8 / 16 * n / h100.inter_node_link.bandwidth + 8 * h100.inter_node_link.latency)
    assert split < flat
    # inside one node: the NVLink ring formula, unchanged
    assert axis_collective_time("all_to_all", n, h100, 8) == collective_time("all_to_all", n, 8, h100.intra_node_link)


def test_h800_is_an_h100_with_half_the_nvlink():
    h800, h100 = get_device("h800"), get_device("h100")
    assert h800.peak_flops == h100.peak_flops and h800.memory_bytes == h100.memory_bytes
    assert h800.intra_node_link.bandwidth == h100.intra_node_link.bandwidth / 2.25
    assert h800.inter_node_link == h100.inter_node_link


def test_moe_imbalance_context_key():
    try:
        assert autopar.get_auto_parallel_context()["moe_imbalance"] == 1.1
        autopar.set_auto_parallel_context(moe_imbalance=1.0)
        assert autopar.get_auto_parallel_context()["moe_imbalance"] == 1.0
        for bad in (0.9, "1.2", True, float("nan")):
            with pytest.raises(ValueError, match="moe_imbalance must be a number >= 1"):
                autopar.set_auto_parallel_context(moe_imbalance=bad)
    finally:
        autopar.reset_auto_parallel_context()
