"""A plan's predicted peak memory per device, by part, with devices that hold the same grouped.

A plan predicts one peak per device (``plan.memory_per_device``) and the fullest device's parts
(``plan.memory_breakdown``). This splits every device's peak into parameters, gradients,
optimizer state (``memory_explain``'s per-parameter table, under the plan's ZeRO stage),
activations and the breakdown's other terms (transient, inputs, pipeline buffers, ...), and groups
devices with the same pipeline stages and the same peak: a 3072-device data-parallel plan is one
group, a pipeline one group per pipeline rank.

Without a pipeline every device holds the same, so the fullest device's breakdown is every
device's. In a pipeline a rank holds its stages' parameters (a parameter belongs to a stage when
one of the stage's ops runs in the parameter's module, so a tied embedding counts on both ends)
and the same added terms on every rank (``pipeline_search._stage_memory``); activations are the
rest of its peak.
"""
from __future__ import annotations

from dataclasses import dataclass

from autopar.report.memory_explain import PARTS, param_effect

STATE = "params+grads+optimizer"
ACTIVATIONS = "activations"


@dataclass
class DeviceGroup:
    """Devices ``ranks`` (holding pipeline ``stages``, empty without a pipeline) and their bytes by part."""

    ranks: list[int]
    stages: list[int]
    parts: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def label(self, world: int) -> str:
        """``all 8 devices``, ``device 3``, ``devices 0-3, 8-11``; pipeline stages first."""
        if len(self.ranks) == world and not self.stages:
            who = f"all {world} devices" if world > 1 else "the device"
        else:
            who = ("device " if len(self.ranks) == 1 else "devices ") + rank_runs(self.ranks)
        if not self.stages:
            return who
        return ("stage " if len(self.stages) == 1 else "stages ") + ",".join(map(str, self.stages)) + "\n" + who


def rank_runs(ranks: list[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``0-3, 8``."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def device_groups(plan) -> list[DeviceGroup]:
    """One group per distinct (pipeline stages, peak), in rank order; each group's parts sum to its peak."""
    peaks = plan.memory_per_device
    stages_of = {r: [s.index for s in plan.stages if r in s.ranks] for r in range(len(peaks))}
    groups: dict[tuple, DeviceGroup] = {}
    for r, peak in enumerate(peaks):
        key = (tuple(stages_of[r]), peak)
        if key not in groups:
            groups[key] = DeviceGroup([], stages_of[r], _parts(plan, stages_of[r], peak))
        groups[key].ranks.append(r)
    return list(groups.values())


def _parts(plan, stages: list[int], peak: float) -> dict[str, float]:
    breakdown = dict(plan.memory_breakdown)
    if not breakdown:
        return {"total (no breakdown)": peak}
    extras = {k: v for k, v in breakdown.items() if k not in (STATE, ACTIVATIONS) and v}
    if plan.stages:
        state = _state(plan, _stage_params(plan, stages))
    else:
        state = _scaled(_state(plan, _trainable_names(plan)), breakdown.get(STATE, 0.0))
    rest = peak - sum(state.values()) - sum(extras.values())
    return {**state, ACTIVATIONS: max(0.0, rest), **extras}


def _trainable_names(plan) -> list[str]:
    return [n for n, d in plan.params.items() if d.kind == "parameter"]


def _state(plan, names: list[str]) -> dict[str, float]:
    """Parameters, gradients, optimizer state of ``names`` on one rank, under the plan's ZeRO stage."""
    out = dict.fromkeys(PARTS, 0.0)
    for name in names:
        after = param_effect(plan, name, plan.memory_options.zero).after
        for k in PARTS:
            out[k] += after[k]
    return out


def _scaled(parts: dict[str, float], total: float) -> dict[str, float]:
    """``parts`` in the same proportions, summing to ``total`` (the solver's own count of the state)."""
    have = sum(parts.values())
    if not have:
        return {PARTS[0]: total} if total else parts
    return {k: v * total / have for k, v in parts.items()}


def _stage_params(plan, stages: list[int]) -> list[str]:
    """Parameters used by ops of ``stages``: an op runs in the parameter's module or one inside it."""
    modules = {plan.nodes[n].module for s in stages for n in plan.stages[s].nodes if n in plan.nodes}

    def used(alias: str) -> bool:
        owner = alias.rpartition(".")[0]
        return owner in modules or any(m.startswith(owner + ".") for m in modules if owner)

    return [n for n in _trainable_names(plan) if any(used(a) for a in plan.params[n].aliases or [n])]
