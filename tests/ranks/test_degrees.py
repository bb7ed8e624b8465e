"""``plan.degrees`` counts what the plan splits: an axis on which every rank repeats the work is
neither dp nor tp, the report says so, and AUTO does not pick such a plan while another uses every axis."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import autopar
from conftest import run_ranks
from examples.models import GPT, MLP, lm_loss
from oracle import make_batch

A100 = "a100-80gb"


def _small_mlp_plan(mesh, mode):
    x, y = torch.randn(8, 8), torch.zeros(8, dtype=torch.long)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    return autopar.plan(model, mesh, example_inputs=(x,), loss_fn=F.cross_entropy, example_target=y, mode=mode)


def test_stand_alone_splits_nothing():
    x, y = make_batch("tokens", 8)
    plan = autopar.plan(GPT(qkv_bias=False, layers=2, hidden=32), autopar.Mesh(4), example_inputs=(x,),
                        loss_fn=lm_loss, example_target=y, mode="stand_alone")
    assert plan.degrees == {"dp": 1, "tp": 1, "pp": 1, "ep": 1, "cp": 1}
    assert plan.axis_roles == {"d0": "none"} and plan.redundant_axes() == ["d0"]
    assert "axis d0 (size 4): no op is split on it — every rank on it repeats the same work" in plan.report()


def test_auto_plan_that_can_split_nothing_says_so():
    """Batch 1 and sizes 3, 5 on 2 devices: no dimension divides, so nothing can be split."""
    plan = autopar.plan(nn.Linear(3, 5), autopar.Mesh(2), example_inputs=(torch.randn(1, 3),), mode="auto")
    assert plan.degrees == {"dp": 1, "tp": 1, "pp": 1, "ep": 1, "cp": 1}
    assert "axis d0 (size 2): no op is split on it — every rank on it repeats the same work" in plan.report()


def test_semi_auto_batch_gathered_over_dp_is_not_data_parallel():
    """The batch enters split over dp, the annotated column-parallel layer takes it whole: every dp
    rank then runs the same program on the same batch."""
    x, y = make_batch("vector", 8)
    autopar.shard({"layers.0": ColwiseParallel(), "layers.1": RowwiseParallel()}, axis="tp")
    plan = autopar.plan(MLP(), autopar.Mesh((2, 2), axis_names=("dp", "tp"), device=A100), example_inputs=(x,),
                        loss_fn=F.cross_entropy, example_target=y, mode="semi_auto")
    first = next(iter(plan.nodes.values()))
    assert str(plan.inputs["args_0"]) == "[S(0),R]" and str(first.inputs[0]) == "[R,R]", "the batch must be gathered over dp"
    assert plan.degrees == {"dp": 1, "tp": 2, "pp": 1, "ep": 1, "cp": 1}
    assert plan.axis_roles == {"dp": "none", "tp": "tp"}
    report = plan.report()
    assert "degrees: dp=1 tp=2 pp=1" in report
    assert "axis dp (size 2): no op is split on it — every rank on it repeats the same work" in report
    assert "axis tp" not in report.split("predicted step time")[0]


def test_data_plan_is_data_parallel():
    plan = _small_mlp_plan(autopar.Mesh(4, device=A100), "data")
    assert plan.degrees == {"dp": 4, "tp": 1, "pp": 1, "ep": 1, "cp": 1} and plan.axis_roles == {"d0": "dp"}
    assert plan.redundant_axes() == []


@pytest.mark.parametrize("n", [4, 2])
def test_auto_prefers_a_plan_that_uses_every_axis(n):
    """A replicated plan is predicted faster on this tiny model, but it wastes the devices. On a
    prime number of devices the free 1-D mesh is the only factorisation: DDP's layout is tried
    there too (a CNN and a ViT on 2 devices got the replicated plan)."""
    plan = _small_mlp_plan(autopar.Mesh(n, device=A100), "auto")
    assert plan.redundant_axes() == [] and plan.degrees["dp"] * plan.degrees["tp"] == n
    wasting = [a for a in plan.alternatives if a.fits and a.redundant_axes]
    assert any(a.step_time < plan.step_time for a in wasting)
    assert "repeats work on" in plan.report()


def test_plan_without_axis_roles_still_loads():
    data = _small_mlp_plan(autopar.Mesh(2, device=A100), "data").to_dict()
    del data["axis_roles"]
    for a in data["alternatives"]:
        a.pop("redundant_axes", None)
    plan = autopar.Plan.from_dict(data)
    assert plan.redundant_axes() == [] and "no op is split" not in plan.report()


def _dp_rank(rank):
    x, y = make_batch("vector", 8)
    torch.manual_seed(0)
    pmodel = autopar.parallelize(MLP(), autopar.Mesh(2), example_inputs=(x,), loss_fn=F.cross_entropy,
                                 example_target=y, mode="data")
    part = x.chunk(pmodel.data_parallel_size)[pmodel.data_parallel_rank]
    loss = pmodel.step(part, target=y.chunk(pmodel.data_parallel_size)[pmodel.data_parallel_rank], local_batch=True)
    return pmodel.data_parallel_rank, pmodel.data_parallel_size, float(loss)


def test_data_parallel_rank_and_size():
    x, y = make_batch("vector", 8)
    torch.manual_seed(0)
    with torch.no_grad():
        ref = float(F.cross_entropy(MLP()(x), y))
    results = run_ranks(2, _dp_rank)
    assert [(r, s) for r, s, _ in results] == [(0, 2), (1, 2)]
    assert all(abs(loss - ref) <= 1e-5 * ref for _, _, loss in results)
    solo = autopar.parallelize(MLP(), autopar.Mesh(1), example_inputs=(x,), mode="stand_alone")
    assert (solo.data_parallel_rank, solo.data_parallel_size) == (0, 1)


def test_a_batch_split_made_after_a_replicated_input_is_data_parallel():
    """Token ids kept whole on the axis, the embedding's output cut by rows and everything after it
    split the same way: each rank computes its rows, which is data parallelism (Table 1's AUTO plans
    were labelled tensor parallel). The same graph with the hidden dimension cut is tensor parallel."""
    from types import SimpleNamespace

    from autopar.sharding.placements import Replicate, Shard, Spec
    from autopar.solver.degrees import axis_shares, role
    from autopar.frontend.trace import trace

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.out = nn.Embedding(16, 8), nn.Linear(8, 16)

        def forward(self, ids):
            return self.out(torch.relu(self.emb(ids)))

    traced = trace(Tiny(), (torch.zeros(4, 6, dtype=torch.long),))
    gm = traced.gm
    inputs = {n.name: Spec([Replicate()]) for n in gm.graph.nodes
              if n.op == "placeholder" and n.name not in traced.params}

    def decided(dim_of):
        out = {}
        for n in gm.graph.nodes:
            if n.op == "call_function":
                ins = [Spec([Replicate()]) if a.name in traced.params or a.name in inputs else Spec([Shard(dim_of(a))])
                       for a in n.all_input_nodes]
                out[n.name] = SimpleNamespace(inputs=ins, output=Spec([Shard(dim_of(n))]))
        return out

    rows = axis_shares(gm, decided(lambda node: 0), inputs, ("d0",), (4,))
    assert role(rows["d0"]) == "dp", rows
    hidden = axis_shares(gm, decided(lambda node: node.meta["val"].dim() - 1), inputs, ("d0",), (4,))
    assert role(hidden["d0"]) == "tp", hidden
