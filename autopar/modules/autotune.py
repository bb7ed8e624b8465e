"""AUTO's measured choice: time the best predicted plans on the real ranks, keep the fastest.

The cost model ranks plans; where its top candidates lie within its error of each other, the
ranks themselves decide (as Alpa profiles its stage candidates). With the context setting
``autotune_top_k = k > 1`` (the default, 6) and a running process group, ``parallelize`` in AUTO
mode takes the shortlist of the k best predicted plans, keeping those predicted within
``autotune_slack`` (1.5) times the best and dropping repeats of one layout under another mesh name::

    shortlist = distinct { p in top_k : predicted(p) <= slack * predicted(best) }

It builds each on a copy of the model and runs ``warmup`` + ``steps`` training steps
(``pmodel.step`` on the example batch, then the plan's optimizer — AdamW, or SGD when the plan was
made for it — on the copy's parameters), the plans interleaved round by round so that a change of
machine load hits all of them alike (in a new order each round: what ran before a step changes its
caches); when the copies would not fit the device together
(sum of predicted peaks > the memory budget) one plan is built, timed and freed at a time::

    measured(plan) = max over ranks of median_rounds(step + optimizer seconds)
    close          = the 2 fastest ∪ { p : measured(p) <= 1.1 * min measured }
                     (2 * steps more rounds each, samples pooled)
    chosen         = the best predicted p with measured(p) <= 1.03 * min measured

Steps of plans a few per cent apart differ by about as much from one round to the next when
ranks share cores (a median of 5 steps moved by 10-15 % between runs here), so the leader and the
close calls get three times the rounds of the clear losers.

Every rank gets the same maxima from one all-reduce, so every rank picks the same plan. The
user's model, its buffers and the RNG state are left as they were. The trials go to
``plan.autotune`` and the report.

A plan that cannot be built on some rank is not timed and runs on no rank; its trial keeps the
reason (``KeyError: 'submod_3' (split_stages.py:162 in _stage_graph) on rank 0``: exception type,
message, where it was raised, and the first rank it failed on, the same on every rank) and rank 0
warns (RuntimeWarning). A plan is built from the same Plan as any other, so such a failure is
a bug of the passes, not a property of the plan. A plan that fails while timed stops ``parallelize``
with an error naming it (its peers may be waiting on it: it cannot be skipped).
"""
from __future__ import annotations

import copy
import gc
import json
import random
import statistics
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopar.collectives.watch import note
from autopar.core.comm_timeout import world_group
from autopar.core.errors import CommError
from autopar.plan.plan import AutotuneTrial, Plan


@dataclass(frozen=True)
class Trial:
    """One plan timed on the ranks."""

    label: str
    predicted: float      # plan.step_time, seconds
    measured: float       # slowest rank's median step: forward, backward, gradient sync and optimizer
    error: str = ""       # why it could not be built: type, message, where, rank (measured = inf)
    steps: int = 0        # timed steps behind ``measured`` (this rank's)


def plan_label(plan: Plan) -> str:
    """``pp=2 dp=1 tp=2 [pp=2 × tp=2] 4×1f1b``: degrees, mesh and schedule."""
    d = plan.degrees
    mesh = " × ".join(f"{n}={s}" for n, s in zip(plan.mesh.axis_names, plan.mesh.shape))
    sched = f" {plan.microbatches}×{plan.schedule}" if plan.schedule != "none" else ""
    note = f" ({plan.candidate})" if plan.candidate else ""
    extra = "".join(f" {k}={d[k]}" for k in ("ep", "cp") if d.get(k, 1) > 1)
    return f"pp={d.get('pp', 1)} dp={d.get('dp', 1)} tp={d.get('tp', 1)}{extra} [{mesh}]{sched}{note}"


def layout_key(plan: Plan) -> str:
    """What a plan runs, without its mesh's axis names: equal keys are one layout under two names."""
    nodes = {k: [n.strategy, n.inputs, n.output] for k, n in plan.nodes.items()}
    return json.dumps([list(plan.mesh.shape), plan.microbatches, plan.schedule, [s.ranks for s in plan.stages], nodes,
                       {k: p.spec for k, p in plan.params.items()}, plan.inputs], sort_keys=True, default=str)


def shortlist(plans: list[Plan], slack: float) -> list[Plan]:
    """The plans (best predicted first) worth timing: predicted within ``slack`` x the best, one per layout."""
    out, seen = [], set()
    for plan in plans:
        key = layout_key(plan)
        if plan.step_time <= slack * plans[0].step_time and key not in seen:
            seen.add(key)
            out.append(plan)
    return out


def measure_plans(plans: list[Plan], build: Callable[[Plan], object], example_inputs: tuple, example_target,
                  steps: int = 3, warmup: int = 1, together: bool = True, race: float = 0.1,
                  example_kwargs: dict | None = None) -> list[Trial]:
    """Build every plan (``build(plan)`` -> a ParallelModule) and time its training steps;
    collective over the default process group (every rank calls it alike). ``together``: all
    plans built at once and timed interleaved; otherwise built, timed and freed one at a time.
    ``race``: the two fastest and every plan measured within ``1 + race`` of the fastest are timed
    ``2 * steps`` more rounds (their samples pooled), so that the leader is always checked against
    the runner-up and the close calls get the most measurements."""
    rng = torch.get_rng_state()
    timer = _Timer(plans, build, example_inputs, example_target, warmup, together, example_kwargs or {})
    timer.run(list(range(len(plans))), steps)
    med = timer.medians()
    best = min(med)
    ranked = sorted((i for i, m in enumerate(med) if m < float("inf")), key=med.__getitem__)
    close = sorted(set(ranked[:2]) | {i for i in ranked if med[i] <= (1 + race) * best})
    if race > 0 and len(close) > 1:
        timer.run(close, 2 * steps)
        med = timer.medians()
    timer.free()
    torch.set_rng_state(rng)
    return [Trial(plan_label(plan), plan.step_time, med[i] if not timer.errors[i] else float("inf"), timer.errors[i],
                  len(timer.samples[i])) for i, plan in enumerate(plans)]


def failure(err: BaseException) -> str:
    """``KeyError: 'submod_3' (split_stages.py:162 in _stage_graph)``: type, message and the
    innermost frame, enough to tell a bug from a plan that cannot fit."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f" ({frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{type(err).__name__}: {err}{where}"


class _Timer:
    """Timed training steps of plans on trial copies, every rank alike (see ``measure_plans``)."""

    def __init__(self, plans, build, example_inputs, example_target, warmup: int, together: bool, example_kwargs):
        self.plans, self.build, self.inputs, self.target = plans, build, example_inputs, example_target
        self.kwargs = example_kwargs
        self.warmup, self.together = warmup, together
        self.samples: list[list[float]] = [[] for _ in plans]
        self.errors = [""] * len(plans)
        self.kept: dict[int, tuple] = {}
        self.rounds = 0                   # rounds run so far: seeds each round's order alike on every rank

    def run(self, indices: list[int], rounds: int) -> None:
        """``rounds`` timed rounds of ``indices`` (after ``warmup`` untimed ones for new builds)."""
        for group in ([indices] if self.together else [[i] for i in indices]):
            runs = self._built(group)
            fresh = any(not self.samples[i] for i in runs)
            warm = self.warmup if fresh or not self.together else 0
            for r in range(warm + rounds):
                self.rounds += 1
                order = random.Random(self.rounds).sample(list(runs), len(runs))
                for i in order:                 # a new order each round, the same on every rank
                    pm, opt = runs[i]
                    if dist.is_initialized():
                        note("barrier", detail="before a timed autotune step")
                        dist.barrier(group=world_group())
                    t0 = time.perf_counter()
                    try:
                        pm.step(*self.inputs, target=self.target, **self.kwargs)
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                    except CommError:
                        raise
                    except Exception as err:
                        raise RuntimeError(f"autotune: plan {plan_label(self.plans[i])} was built but failed while "
                                           f"timed: {failure(err)}") from err
                    if r >= warm:
                        self.samples[i].append(time.perf_counter() - t0)
            if not self.together:
                runs.clear()
                pm = opt = None      # the loop's last module too: the next plan is built in its place, not beside it
                gc.collect()

    def _built(self, group: list[int]) -> dict:
        runs = {i: self.kept[i] for i in group if i in self.kept}
        todo = [i for i in group if i not in runs and not self.errors[i]]
        if not todo:
            return runs
        mine = {}
        for i in todo:
            try:
                pm = self.build(self.plans[i])
                runs[i] = (pm, _optimizer(self.plans[i], pm))
            except Exception as err:  # noqa: BLE001 - a plan that cannot be built loses, with the reason kept
                mine[i] = failure(err)
        per_rank = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            per_rank = [None] * dist.get_world_size()
            note("all_gather_object", detail="of which autotune plans each rank could build")
            dist.all_gather_object(per_rank, mine, group=world_group())    # a plan that failed on any rank runs on none
        for rank, errors in enumerate(per_rank):
            for i, reason in errors.items():
                if not self.errors[i]:
                    self.errors[i] = f"{reason} on rank {rank}"
                runs.pop(i, None)
        if self.together:
            self.kept.update(runs)
        return runs

    def medians(self) -> list[float]:
        """Per plan, the slowest rank's median step (inf for a plan that did not run)."""
        med = torch.tensor([statistics.median(t) if t else float("inf") for t in self.samples], dtype=torch.float64)
        if dist.is_initialized():
            note("all_reduce", detail="of the autotune step times")
            dist.all_reduce(med, op=dist.ReduceOp.MAX, group=world_group())
        return med.tolist()

    def free(self) -> None:
        self.kept.clear()
        gc.collect()


TIE = 0.03   # measured steps this close are not told apart by a few timed steps on shared cores


def pick(trials: list[Trial], tie: float = TIE) -> int:
    """Index of the chosen trial (trials in predicted order): among those measured within
    ``1 + tie`` of the fastest, the best predicted — where the clock cannot tell plans apart, the
    cost model does. 0 when none ran."""
    fastest = min(t.measured for t in trials)
    if fastest == float("inf"):
        return 0
    return next(i for i, t in enumerate(trials) if t.measured <= (1 + tie) * fastest)


def _optimizer(plan: Plan, pmodel) -> torch.optim.Optimizer:
    """The optimizer the plan was costed for, on the trial copy's parameters."""
    params = list(pmodel.parameters())
    if str(plan.optimizer).lower() == "sgd":
        return torch.optim.SGD(params, lr=1e-3)
    return torch.optim.AdamW(params, lr=1e-3)


def choose(plans: list[Plan], model: torch.nn.Module, build: Callable[[torch.nn.Module, Plan], object],
           example_inputs: tuple, example_target, steps: int = 3, slack: float = 1.5,
           example_kwargs: dict | None = None, one_at_a_time: bool = False) -> Plan:
    """The plan of ``shortlist(plans, slack)`` (best predicted first) that ``pick`` takes from the
    measured trials; records the trials in its ``autotune``. Each trial runs on a deep copy of
    ``model``; the copies are built together only when their predicted peaks fit the budget (never
    with ``one_at_a_time``: a meta model, whose real size the budget may not hold several times)."""
    plans = shortlist(plans, slack)
    if len(plans) < 2:
        return plans[0]
    budget = plans[0].memory_budget or float("inf")
    together = not one_at_a_time and sum(max(p.memory_per_device, default=0.0) for p in plans) <= budget
    trials = measure_plans(plans, lambda p: build(copy.deepcopy(model), p), example_inputs, example_target, steps,
                           together=together, example_kwargs=example_kwargs)
    if not dist.is_initialized() or dist.get_rank() == 0:
        for t in trials:
            if t.error:
                warnings.warn(f"autotune: plan {t.label} could not be built and was not timed: {t.error}",
                              RuntimeWarning, stacklevel=2)
    best = pick(trials)
    chosen = plans[best]
    chosen.autotune = [AutotuneTrial(t.label, t.predicted, t.measured if t.measured < float("inf") else None,
                                     t.steps, t.error, i == best) for i, t in enumerate(trials)]
    chosen.autotune_timing = "interleaved" if together else "one plan at a time (copies exceed memory)"
    return chosen


__all__ = ["TIE", "Trial", "choose", "failure", "pick", "layout_key", "measure_plans", "plan_label", "shortlist"]
