"""Pipeline stages without parameters: the partition solver avoids them whenever a cut does, and a
rank a requested pipeline leaves without parameters still runs the standard loop (issue 32, part 4).

HF ``ResNetForImageClassification`` at a tiny config traces into 4 cut units, the third of which
(the classifier's ``flatten``) holds no parameters: on 4 pipeline ranks it was a stage alone, and
``torch.optim.SGD(pmodel.parameters())`` on its rank raised torch's "empty parameter list".
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.solver.inter_op import (CutRules, IdleStageError, LayerProfile, brute_force_partition, partition_stages)
from conftest import run_ranks
from oracle import assert_same_training, parallel_run, reference_run

pytest.importorskip("transformers")


class LogitsOnly(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(pixel_values=x).logits


def resnet():
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=10)
    return LogitsOnly(ResNetForImageClassification(cfg))


def images(batch: int = 8):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)


# ---- the partition solver --------------------------------------------------------------------

def _profiles(params: list[float]) -> list[LayerProfile]:
    """Layer 1 is the slowest, so that the fastest cut gives it a stage alone."""
    times = [1.0, 3.0, 1.0, 1.0, 1.0][: len(params)]
    return [LayerProfile(f"l{i}", t, 2 * t, p, 1.0, 1.0) for i, (t, p) in enumerate(zip(times, params))]


@pytest.mark.parametrize("solver", [partition_stages, brute_force_partition])
def test_partition_gives_every_stage_parameters_when_a_cut_does(solver):
    layers = _profiles([10.0, 0.0, 10.0, 10.0, 10.0])
    free = solver([LayerProfile(x.name, x.fwd, x.bwd, 1.0, 1.0, 1.0) for x in layers], 4, 4)
    assert [s.layers for s in free.stages][1] == (1, 2)        # with parameters everywhere: layer 1 alone
    part = solver(layers, 4, 4)
    held = [sum(x.param_bytes for x in layers[a:b]) for a, b in (s.layers for s in part.stages)]
    assert all(h > 0 for h in held), [s.layers for s in part.stages]
    assert part.idle_stages == []


def test_partition_with_no_other_cut_keeps_the_idle_stage_or_refuses():
    layers = _profiles([10.0, 0.0, 10.0, 10.0])
    part = partition_stages(layers, 4, 1)                          # allow_idle: the only cut there is
    assert part.idle_stages == [1]
    with pytest.raises(IdleStageError, match=r"leaves a stage without parameters \(stage 1 \(l1\)\).*fewer stages"):
        partition_stages(layers, 4, 1, rules=CutRules(allow_idle=False))
    with pytest.raises(IdleStageError, match="stage 1"):
        brute_force_partition(layers, 4, 1, rules=CutRules(allow_idle=False))


def test_auto_plans_no_parameterless_stage_for_resnet():
    x, y = images()
    model = resnet().eval()     # eval: batch norm reads its running statistics, so AUTO may pipeline it
    plan = autopar.plan(model, autopar.Mesh(4), example_inputs=(x,), loss_fn=F.cross_entropy,
                        example_target=y, mode="auto")
    assert plan.degrees["pp"] != 4
    refused = [a.note for a in plan.alternatives if a.note.startswith("pp=4")]
    assert refused and all("without parameters (stage 2 (inner.classifier.0))" in n for n in refused), refused


# ---- a rank without parameters runs the standard loop -------------------------------------------

def _checkpoint_round_trip(pmodel, x, y, folder) -> bool:
    """Save with an optimizer over the placeholder (on the idle rank), load into a fresh one: same momenta."""
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.05, momentum=0.9)
    pmodel.step(x, target=y)
    opt.step()
    pmodel.save(f"{folder}/ckpt", optimizer=opt)
    again = torch.optim.SGD(pmodel.parameters(), lr=0.05, momentum=0.9)
    pmodel.load(f"{folder}/ckpt", optimizer=again)
    before, after = opt.state_dict()["state"], again.state_dict()["state"]
    return sorted(before) == sorted(after) and all(
        torch.equal(before[i]["momentum_buffer"], after[i]["momentum_buffer"]) for i in before)


def _idle_job(rank, folder):
    autopar.set_auto_parallel_context(microbatches=1)      # batch norm: one microbatch matches one device
    x, y = images()
    mesh = autopar.Mesh((4,), axis_names=("pp",))           # a requested pipeline: the idle stage stays

    def inspect(pmodel):
        return {"own": [n for n, _ in pmodel.named_parameters()], "offered": [list(p.shape) for p in pmodel.parameters()],
                "state": sorted(pmodel.state_dict()), "stages": [s.layers for s in pmodel.plan.stages],
                "checkpoint": _checkpoint_round_trip(pmodel, x, y, folder)}

    return parallel_run(rank, resnet, F.cross_entropy, x, y, mesh, "auto", optim="sgd", inspect=inspect)


def test_parameterless_rank_trains_like_one_device(tmp_path):
    x, y = images()
    ref = reference_run(resnet, F.cross_entropy, x, y, optim="sgd")
    results = run_ranks(4, _idle_job, str(tmp_path))
    idle = [r for r, res in enumerate(results) if not res["inspect"]["own"]]
    assert idle, results[0]["inspect"]["stages"]                   # the plan leaves a rank without parameters
    for r in idle:
        assert results[r]["inspect"]["offered"] == [[0]]          # the placeholder, outside the state dict
        assert not any("placeholder" in k for k in results[r]["inspect"]["state"])
    for r, res in enumerate(results):
        assert_same_training(ref, res, what=f"resnet pp=4 rank {r}")
        assert res["inspect"]["checkpoint"], f"rank {r}: the optimizer state did not survive save and load"
