"""AUTO's measured choice: time the best predicted plans on the real ranks, keep the fastest.

The cost model ranks plans; where its top candidates lie within its error of each other, the
ranks themselves decide (as Alpa profiles its stage candidates). With the context setting
``autotune_top_k = k > 1`` and a running process group, ``parallelize`` in AUTO mode builds
each of the k best predicted plans on a copy of the model and runs ``warmup`` + ``steps``
training steps (``pmodel.step`` on the example batch, then the plan's optimizer — AdamW, or SGD
when the plan was made for it — on the copy's parameters), the plans interleaved round by round so
that a change of machine load hits all of them alike::

    measured(plan) = max over ranks of median_rounds(step + optimizer seconds)
    chosen         = argmin measured (ties: the better predicted)

Every rank gets the same maxima from one all-reduce, so every rank picks the same plan. The
user's model, its buffers and the RNG state are left as they were. The trials go to
``plan.options["autotune"]`` and the report.
"""
from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from autopar.plan import Plan


@dataclass(frozen=True)
class Trial:
    """One plan timed on the ranks."""

    label: str
    predicted: float      # plan.step_time, seconds
    measured: float       # slowest rank's median step: forward, backward, gradient sync and optimizer
    error: str = ""       # why it could not be built or run (measured = inf)


def plan_label(plan: Plan) -> str:
    """``pp=2 dp=1 tp=2 [pp=2 × tp=2] 4×1f1b``: degrees, mesh and schedule."""
    d = plan.degrees
    mesh = " × ".join(f"{n}={s}" for n, s in zip(plan.mesh.axis_names, plan.mesh.shape))
    sched = f" {plan.microbatches}×{plan.schedule}" if plan.schedule != "none" else ""
    note = f" ({plan.options['candidate']})" if plan.options.get("candidate") else ""
    return f"pp={d.get('pp', 1)} dp={d.get('dp', 1)} tp={d.get('tp', 1)} [{mesh}]{sched}{note}"


def measure_plans(plans: list[Plan], build: Callable[[Plan], object], example_inputs: tuple, example_target,
                  steps: int = 3, warmup: int = 1) -> list[Trial]:
    """Build every plan (``build(plan)`` -> a ParallelModule) and time its training steps,
    interleaved; collective over the default process group (every rank calls it alike)."""
    rng = torch.get_rng_state()
    modules, optimizers, errors = [], [], []
    for plan in plans:
        try:
            pm = build(plan)
            modules.append(pm)
            optimizers.append(_optimizer(plan, pm))
            errors.append("")
        except Exception as err:  # noqa: BLE001 - a plan that cannot be built loses, with the reason kept
            modules.append(None)
            optimizers.append(None)
            errors.append(f"{type(err).__name__}: {err}")
    built = torch.tensor([0.0 if m is not None else 1.0 for m in modules], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(built, op=dist.ReduceOp.MAX)    # a plan that failed on any rank runs on none
    times: list[list[float]] = [[] for _ in plans]
    for r in range(warmup + steps):
        for i, pm in enumerate(modules):
            if pm is None or built[i] > 0:
                continue
            if dist.is_initialized():
                dist.barrier()
            t0 = time.perf_counter()
            pm.step(*example_inputs, target=example_target)
            optimizers[i].step()
            optimizers[i].zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - t0
            if r >= warmup:
                times[i].append(elapsed)
    med = torch.tensor([statistics.median(t) if t else float("inf") for t in times], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
    torch.set_rng_state(rng)
    trials = []
    for plan, m, err, bad in zip(plans, med.tolist(), errors, built.tolist()):
        reason = err or ("could not be built on another rank" if bad else "")
        trials.append(Trial(plan_label(plan), plan.step_time, m if not reason else float("inf"), reason))
    return trials


def _optimizer(plan: Plan, pmodel) -> torch.optim.Optimizer:
    """The optimizer the plan was costed for, on the trial copy's parameters."""
    params = list(pmodel.parameters())
    if str(plan.options.get("optimizer", "adamw")).lower() == "sgd":
        return torch.optim.SGD(params, lr=1e-3)
    return torch.optim.AdamW(params, lr=1e-3)


def choose(plans: list[Plan], model: torch.nn.Module, build: Callable[[torch.nn.Module, Plan], object],
           example_inputs: tuple, example_target, steps: int = 3) -> Plan:
    """The plan of ``plans`` (best predicted first) whose measured step is least; records the
    trials in its ``options["autotune"]``. Each trial runs on a deep copy of ``model``."""
    if len(plans) < 2:
        return plans[0]
    trials = measure_plans(plans, lambda p: build(copy.deepcopy(model), p), example_inputs, example_target, steps)
    best = min(range(len(plans)), key=lambda i: (trials[i].measured, i))
    if trials[best].measured == float("inf"):
        best = 0
    chosen = plans[best]
    chosen.options["autotune"] = [dict(asdict(t), measured=t.measured if t.measured < float("inf") else None,
                                       chosen=(i == best)) for i, t in enumerate(trials)]
    return chosen


__all__ = ["Trial", "choose", "measure_plans", "plan_label"]
