"""Planning ZeRO-1 with a pipeline (no processes): each stage's predicted memory drops by its parameters'
optimizer state sharded over dp, the gradient all-reduce becomes a reduce-scatter and an all-gather, the
optimizer step divides; ZeRO-2 and 3 with a pipeline are refused by name."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.cost_models.memory import training_state_parts
from examples.models import MLP

G = torch.Generator().manual_seed(1)
X, Y = torch.randn(16, 32, generator=G), torch.randint(0, 10, (16,), generator=G)


@functools.lru_cache(maxsize=None)
def _plan(zero: int):
    autopar.reset_auto_parallel_context()
    autopar.clear_annotations()
    try:
        autopar.set_auto_parallel_context(schedule="gpipe", microbatches=2, zero=zero)
        autopar.pipeline_stage("layers.1", 1)
        return autopar.plan(MLP(), autopar.Mesh((2, 2), axis_names=("pp", "dp")), example_inputs=(X,),
                            loss_fn=F.cross_entropy, example_target=Y, mode="semi_auto")
    finally:
        autopar.reset_auto_parallel_context()
        autopar.clear_annotations()


def _stage_params(plan, stage: int) -> int:
    """Elements of the MLP's parameters on ``stage`` (layers.0 | layers.1 and the head)."""
    names = [n for n in plan.params if n.startswith("layers.0")] if stage == 0 else \
        [n for n in plan.params if not n.startswith("layers.0")]
    return sum(torch.Size(plan.params[n].shape).numel() for n in names)


def test_zero1_with_a_pipeline_shards_each_stages_optimizer_state():
    z0, z1 = _plan(0), _plan(1)
    assert z1.memory_options.zero == 1 and z0.degrees == z1.degrees == {"dp": 2, "tp": 1, "pp": 2, "ep": 1, "cp": 1}
    assert [s.layers for s in z0.stages] == [s.layers for s in z1.stages]
    for s0, s1 in zip(z0.stages, z1.stages):
        _, grads, opt = training_state_parts(_stage_params(z0, s0.index), torch.float32)
        drop = s0.memory - s1.memory
        # the optimizer state halves (dp 2); ZeRO-0's gradients' second copy after the schedule, which may set
        # the stage's peak, is gone too
        assert opt / 2 <= drop + 1e-6 <= opt / 2 + grads, (s0.index, drop, opt, grads)
        # the stage's compute is the same: its gradient sync moves out of the unit times whole (the reduce-scatter)
        assert s1.fwd == pytest.approx(s0.fwd, rel=1e-6) and s1.bwd == pytest.approx(s0.bwd, rel=1e-6), (s0, s1)
    kinds = lambda p: {(c.kind, c.phase) for c in p.collective_list if c.axes == ["dp"]}  # noqa: E731
    assert ("all_reduce", "bwd") in kinds(z0) and ("all_reduce", "bwd") not in kinds(z1)
    assert {("reduce_scatter", "bwd"), ("all_gather", "step")} <= kinds(z1)
    assert z1.optimizer_time < z0.optimizer_time and z1.step_time <= z0.step_time


@pytest.mark.parametrize("zero", [2, 3])
def test_zero2_and_3_with_a_pipeline_are_refused_when_planning(zero):
    with pytest.raises(autopar.PlanError, match=rf"zero={zero} is not supported with a pipeline \(a 'pp' mesh axis, "
                                                r"microbatches or schedule\): .* use zero=1 .* or zero=0"):
        _plan(zero)
