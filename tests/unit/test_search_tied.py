"""The search's per-(graph, mesh) work done once per class of alike nodes (repeated layers), under the
``core/search_memo.py`` switch: candidate lists built once per class and shared as one list object
(``candidates._shared_candidates``), spec rows per list, redistribution times by spec numbers, collective
times memoised per costing, ``node_cost`` once per graph and device, the SP copy edges once per graph.
Each gives the plain code's values; AUTO returns the same plan on and off, on a GPT, a Hugging Face Llama
with grouped-query attention, and a model whose last layer differs from the others (its nodes take their
own lists)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.cost_models.compute import node_cost
from autopar.cost_models.devices import mesh_device
from autopar.cost_models.node_cost_memo import cached_node_cost, node_cost_table
from autopar.frontend.trace import trace
from autopar.sharding import candidates as cand_mod
from autopar.solver.strategy_prices import Costing, _redistribution_by_ids, _redistribution_time
from examples import factories
from tests.unit.test_search_fast import _both
from tests.unit.test_search_memo import _hf_llama, _same_plan


class _Block(nn.Module):
    def __init__(self, width: int, out: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, out)

    def forward(self, x):
        return self.down(torch.relu(self.up(self.norm(x))))


class _LastDiffers(nn.Module):
    """Three alike blocks of width 32 and a last one that narrows to 16 (its shapes differ)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(32, 32) for _ in range(3)] + [_Block(32, 16)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _last_differs():
    torch.manual_seed(0)
    x, y = torch.randn(16, 8, 32), torch.randn(16, 8, 16)
    return _LastDiffers(), (x,), nn.functional.mse_loss, y


def _gpt():
    return factories.gpt(hidden=32, layers=3, heads=2, seq=16, batch=4, vocab=64)


@pytest.mark.parametrize("job", [_gpt, _last_differs])
def test_shared_candidates_equal_the_plain_lists(job, monkeypatch):
    """Equal lists node for node on a 1-D and a 2-D mesh; alike nodes hold one list object; the differing
    last block's nodes whose shapes differ hold their own lists."""
    model, inputs, loss, target = job()
    traced = trace(model, inputs, loss, target)
    for shape in [(4,), (2, 2)]:
        shared, plain = cand_mod._shared_candidates(traced.gm, shape), cand_mod._plain_candidates(traced.gm, shape)
        assert list(shared.strategies) == list(plain.strategies) and shared.unknown_ops == plain.unknown_ops
        for name in plain.strategies:
            assert shared.strategies[name] == plain.strategies[name], name
        ids = [id(v) for v in shared.strategies.values()]
        assert len(set(ids)) < len(ids) / 2, "alike nodes did not share their lists"
    if job is _last_differs:
        by_name = {n.name: n for n in traced.gm.graph.nodes}
        lists = cand_mod._shared_candidates(traced.gm, (2, 2)).strategies
        calls = [n for n in lists if by_name[n].op == "call_function"
                 and isinstance(by_name[n].meta.get("val"), torch.Tensor)]
        narrow = [n for n in calls if tuple(by_name[n].meta["val"].shape)[-1:] == (16,)]
        wide = [n for n in calls if tuple(by_name[n].meta["val"].shape)[-1:] == (32,)]
        assert narrow and wide
        assert all(lists[a] is not lists[b] for a in narrow for b in wide if by_name[a].target == by_name[b].target)


def test_build_candidates_follows_the_switch(monkeypatch):
    traced = trace(*_gpt())
    on, off = _both(monkeypatch, lambda: cand_mod.build_candidates(traced.gm, (2, 2)).strategies)
    assert on == off
    assert len({id(v) for v in on.values()}) < len(on) and len({id(v) for v in off.values()}) == len(off)


def test_redistribution_by_spec_numbers_and_memoised_comm_equal_the_plain_time(monkeypatch):
    """Every pair of output specs of a GPT's nodes on a (2, 4) H100 mesh, at two byte counts, with and
    without the gradient's conjugates: the same float."""
    traced = trace(*_gpt())
    shape = (2, 4)
    specs = list(dict.fromkeys(st.output for sts in cand_mod.build_candidates(traced.gm, shape).strategies.values()
                               for st in sts if st.output and not isinstance(st.output[0], tuple)))
    assert len(specs) > 10
    device = mesh_device(autopar.Mesh(shape, device="h100", gpus_per_node=4))
    memo, plain = Costing(shape, device), Costing(shape, device)
    monkeypatch.setattr(autopar.core.search_memo, "ENABLED", True)
    checked = 0
    for i, a in enumerate(specs):
        for j, b in enumerate(specs):
            for nbytes in (3 * 2**20, 12288.0):
                for grad in (True, False):
                    fast = _redistribution_by_ids(i, j, a, b, nbytes, memo, grad)
                    monkeypatch.setattr(autopar.core.search_memo, "ENABLED", False)
                    slow = _redistribution_time(a, b, nbytes, plain, grad)
                    monkeypatch.setattr(autopar.core.search_memo, "ENABLED", True)
                    assert fast == slow, (a, b, nbytes, grad)
                    checked += fast > 0
    assert checked and memo._comm and not plain._comm


def test_node_cost_table_equals_node_cost(monkeypatch):
    traced = trace(*_gpt())
    device = mesh_device(autopar.Mesh(4, device="h100"))
    monkeypatch.setattr(autopar.core.search_memo, "ENABLED", True)
    table = node_cost_table(traced.gm.graph, device)
    nodes = [n for n in traced.gm.graph.nodes if n.op == "call_function"]
    for n in nodes:
        assert cached_node_cost(table, n, device) == node_cost(n, device)
    assert node_cost_table(traced.gm.graph, device) is table and len(table) == len({n.name for n in nodes})
    other = mesh_device(autopar.Mesh(4, device="a100-80gb"))
    assert node_cost_table(traced.gm.graph, other) is not table
    monkeypatch.setattr(autopar.core.search_memo, "ENABLED", False)
    assert node_cost_table(traced.gm.graph, device) == {}


def test_a_model_whose_last_layer_differs_plans_the_same_on_and_off(monkeypatch):
    plan = _same_plan(_last_differs, autopar.Mesh(4, device="h100", gpus_per_node=2), monkeypatch)
    assert math.isfinite(plan["step_time"])


@pytest.mark.slow
def test_gpt_plans_the_same_on_and_off(monkeypatch):
    """A 4-layer GPT on 8 H100s, 4 per node: pipelines and two-axis meshes."""
    plan = _same_plan(lambda: factories.gpt(hidden=64, layers=4, heads=4, seq=64, batch=16, vocab=2048),
                      autopar.Mesh(8, device="h100", gpus_per_node=4), monkeypatch)
    assert any("pp=" in a["note"] for a in plan["alternatives"])


@pytest.mark.slow
def test_llama_gqa_on_8_devices_plans_the_same_on_and_off(monkeypatch):
    plan = _same_plan(_hf_llama, autopar.Mesh(8, device="h100", gpus_per_node=4), monkeypatch,
                      mixed_precision="bf16")
    assert any("pp=" in a["note"] for a in plan["alternatives"])
