"""A mesh axis of size 1 holds every tensor whole: no strategy splits on it, so no collective runs on it and
no op takes a per-rank form there (a loss summed per rank and divided, which in bf16 rounds otherwise than
the whole op: a one-GPU DATA run then reported 4.875 where one device reports 4.84375)."""
from __future__ import annotations

import functools

import pytest
import torch

import autopar
from examples.models import GPT, lm_loss

MODEL = functools.partial(GPT, vocab=128, hidden=64, heads=4, layers=2, seq=16, dropout=0.0)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, 128, (8, 16), generator=g), torch.randint(0, 128, (8, 16), generator=g)


def _plan(mesh, mode):
    x, y = _data()
    torch.manual_seed(0)
    return autopar.plan(MODEL(), mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, mode=mode)


@pytest.mark.parametrize("mode", ["data", "auto"])
def test_one_device_runs_no_collectives_and_the_plain_ops(mode):
    plan = _plan(autopar.Mesh(1), mode)
    assert plan.collectives() == [], [c.kind for c in plan.collectives()]
    per_rank = {n: d.local for n, d in plan.nodes.items() if any(d.local)}
    assert per_rank == {}, per_rank


def test_an_axis_of_size_one_beside_a_real_one_carries_nothing():
    plan = _plan(autopar.Mesh((2, 1), axis_names=("dp", "tp")), "auto")
    on_tp = [c for c in plan.collectives() if "tp" in tuple(c.axes)]
    assert on_tp == [], [(c.kind, c.axes) for c in on_tp]


def test_bf16_data_on_one_device_reports_the_loss_one_device_does():
    x, y = _data()
    torch.manual_seed(0)
    model = MODEL()
    working = {k: v.to(torch.bfloat16) for k, v in model.named_parameters()}
    want = float(lm_loss(torch.func.functional_call(model, working, (x,)), y).detach())
    torch.manual_seed(0)
    pm = autopar.parallelize(MODEL(), autopar.Mesh(1), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                             mode="data", mixed_precision="bf16")
    assert float(pm.step(x, target=y)) == want


def test_annotations_on_an_axis_of_size_one_hold_the_tensor_whole():
    """torch-style layouts written for tp > 1 still plan when the tp axis has size 1 (a sweep over tp sizes)."""
    x, y = _data()
    torch.manual_seed(0)
    model = MODEL()
    autopar.shard("blocks.*.fc1", weight={"tp": autopar.Shard(0)})
    autopar.shard("blocks.*.fc2", weight={"tp": autopar.Shard(1)})
    autopar.shard_input(0, {"dp": autopar.Shard(0), "tp": autopar.Replicate()})
    plan = autopar.plan(model, autopar.Mesh((2, 1), axis_names=("dp", "tp")), example_inputs=(x,), loss_fn=lm_loss,
                        example_target=y, mode="semi_auto")
    assert [c for c in plan.collectives() if "tp" in tuple(c.axes)] == []
    assert all(str(p.spec[1]) == "R" for n, p in plan.params.items() if ".fc" in n), \
        {n: p.spec for n, p in plan.params.items() if ".fc" in n}
