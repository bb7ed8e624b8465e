"""What each ZeRO stage saves and costs, for ``plan.explain`` and the report: per parameter and
for the whole plan, from the plan's placements (``cost_models/zero.py``'s table).

A parameter is sharded by ZeRO over the axes it is replicated on (``d`` ranks); the bytes are one
rank's, the seconds the all-gathers of the weights a step adds, bucketed as the ILP costs them
(``comm.bucketed_collective_time``; stage 1 and 2: one after the optimizer step, stage 3: forward
and backward).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from autopar.cost_models.comm import bucketed_collective_time
from autopar.cost_models.memory import training_state_parts
from autopar.cost_models.zero import sharded_state, zero_axes
from autopar.sharding.placements import shard_factor
from autopar.cost_models.devices import mesh_device
from autopar.core.units import human_bytes

PARTS = ("parameters", "gradients", "optimizer state")


@dataclass
class ZeroEffect:
    """One rank's bytes of a parameter (or a plan) at stage 0 and at ``stage``, and the seconds added."""

    stage: int
    before: dict
    after: dict
    seconds: float

    def line(self) -> str:
        saved = ", ".join(f"-{human_bytes(self.before[k] - self.after[k])} {k}" for k in PARTS
                          if self.before[k] > self.after[k])
        return f"ZeRO-{self.stage}: {saved or 'nothing sharded'}, +{self.seconds * 1e3:.3f} ms per step"


def param_effect(plan, name: str, stage: int) -> ZeroEffect:
    """ZeRO ``stage``'s effect on one parameter of ``plan``."""
    d = plan.params[name]
    mesh = plan.mesh
    numel = math.prod(d.shape) / shard_factor(d.spec, mesh.shape)
    dtype = getattr(torch, d.dtype.replace("torch.", ""), None)
    parts = training_state_parts(numel, dtype, plan.optimizer, plan.options.get("precision", "fp32"))
    axes, size = zero_axes(d.spec, mesh.shape) if d.trainable else ([], 1)
    after = [sharded_state(*parts[:i], *([0.0] * (3 - i)), size, stage) for i in (1, 2, 3)]
    after = {PARTS[0]: after[0], PARTS[1]: after[1] - after[0], PARTS[2]: after[2] - after[1]}
    device = mesh_device(mesh)
    gathers = 0 if not stage else 2 if stage == 3 else 1
    seconds = gathers * sum(bucketed_collective_time("all_gather", parts[0], device, mesh.shape[a],
                                                     math.prod(mesh.shape[a + 1:])) for a in axes)
    return ZeroEffect(stage, dict(zip(PARTS, parts)), after, seconds)


def plan_effect(plan, stage: int) -> ZeroEffect:
    """ZeRO ``stage``'s effect summed over the plan's parameters."""
    effects = [param_effect(plan, n, stage) for n, d in plan.params.items() if d.kind == "parameter"]
    return ZeroEffect(stage, {k: sum(e.before[k] for e in effects) for k in PARTS},
                      {k: sum(e.after[k] for e in effects) for k in PARTS}, sum(e.seconds for e in effects))


def explain_lines(plan, name: str | None = None) -> list[str]:
    """One line per ZeRO stage 1-3 (for parameter ``name``, or the whole plan), the plan's own marked."""
    out = []
    for stage in (1, 2, 3):
        e = param_effect(plan, name, stage) if name else plan_effect(plan, stage)
        mark = "  (this plan)" if stage == plan.memory_options.zero else ""
        out.append(f"  {e.line()}{mark}")
    return out
