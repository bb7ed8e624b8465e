"""Whether a pipeline candidate can fit memory, decided without solving it, and what a request
allows (microbatch counts, schedules).

``fit_refusal``: lower bounds on what the stage partition charges (``memory_floor``: the training
state split as finely as the sub-mesh allows; saved activations split over all its devices); a
candidate no cut can fit by them is refused before its sub-mesh solve. ``held`` / ``holds_more``:
the activations a schedule keeps in flight per stage at m microbatches (in units of the whole
batch's), by which one count is known to need at least another's memory at every cut.
"""
from __future__ import annotations

import functools
import math

from autopar.cost_models.memory import dropout_mask_bytes_for, param_numel, parameter_nodes, training_state_bytes
from autopar.graph.cut_points import assign_units
from autopar.schedules.schedule import in_flight
from autopar.solver.inter_op import LayerProfile, least_stage_memory
from autopar.solver.memory_floor import state_floor, unit_floors
from autopar.solver.virtual_stages import VirtualStagesError, check_virtual_stages, virtual_stage_choices
from autopar.cost_models.devices import mesh_device

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


class PipelineRequestError(ValueError):
    """A pipeline request that cannot be planned (raised as PlanError by the search)."""


class PipelineDominatedError(PipelineRequestError):
    """A pipeline candidate dropped because a plan the search already has is faster: a reason to list,
    never the search's error (the faster plan exists), even for a requested pipeline."""


def microbatch_counts(batch: int, dp: int, opts) -> list[int]:
    """The microbatch counts m a pipeline may run: m | batch and dp | batch / m (or the one asked for)."""
    if opts.microbatches is not None:
        m = int(opts.microbatches)
        if m < 1 or batch % m:
            raise PipelineRequestError(f"microbatches={m} does not divide the global batch {batch}: every "
                                       f"microbatch must hold the same number of samples; use a divisor of {batch}")
        if (batch // m) % dp:
            raise PipelineRequestError(f"microbatches={m} leaves {batch // m} samples per microbatch, not divisible "
                                       f"by the data-parallel size {dp}")
        return [m]
    counts = [m for m in range(1, batch + 1) if batch % m == 0 and (batch // m) % dp == 0]
    if not counts:
        raise PipelineRequestError(f"the global batch {batch} is not divisible by the data-parallel size {dp} of "
                                   "the stages: no microbatch count splits it evenly; use a batch that is a multiple "
                                   f"of {dp}")
    return counts


def schedules(opts, pp: int, num_units: int, layers: int | None = None) -> list[str]:
    """The schedules to try (the one asked for); interleaved only with two layers per stage or more.
    ``num_units``: the cut units, the end units included (``end_units``); ``layers``: the layers."""
    if opts.schedule is not None and opts.schedule not in SCHEDULES:
        raise PipelineRequestError(f"unknown schedule {opts.schedule!r}; choose one of {', '.join(SCHEDULES)}")
    try:
        check_virtual_stages(opts.virtual_stages, opts.schedule, pp, num_units, layers)
    except VirtualStagesError as err:
        raise PipelineRequestError(str(err)) from None
    if opts.virtual_stages is not None:
        return ["interleaved_1f1b"]
    if opts.schedule is not None:
        return [opts.schedule]
    out = ["gpipe", "1f1b"]
    if (num_units if layers is None else layers) >= 2 * pp:
        out.append("interleaved_1f1b")
    return out


@functools.lru_cache(maxsize=4096)
def held(schedule: str, pp: int, m: int) -> tuple[float, ...]:
    """Per stage, the microbatches in flight over m: the activations a stage holds, in units of one
    whole batch's (each microbatch holds 1 / m of it)."""
    v = 2 if schedule == "interleaved_1f1b" else 1
    return tuple(f / m for f in in_flight(schedule, pp, m, v))


def holds_more(schedule: str, pp: int, m: int, other: int) -> bool:
    """Whether m microbatches hold at least ``other``'s activations in flight on every stage. Never
    for the interleaved schedule: its partition tries several v and checks each rank's peak
    (``interleaved_memory``), which no per-stage comparison at one v bounds."""
    if schedule == "interleaved_1f1b":
        return False
    return all(a >= b for a, b in zip(held(schedule, pp, m), held(schedule, pp, other)))


def budget_bytes(cand, opts) -> float:
    """Bytes one device of the candidate may use."""
    return opts.memory_budget_gb * 2**30 if opts.memory_budget_gb else mesh_device(cand.sub).memory_bytes


def model_parallel_size(sub) -> int:
    """The devices of a sub-mesh that split the weights: all but its "dp" and "cp" axes (a cp rank holds
    the whole layer, as a dp rank does)."""
    named = dict(zip(sub.axis_names, sub.shape))
    return sub.size // (named.get("dp", 1) * named.get("cp", 1))


def model_parallel_first(traced, cands: list, opts) -> list:
    """AUTO's pipeline candidates, those whose training state fits the cap split over their
    model-parallel devices (pp x ``model_parallel_size``) first, each part in its given order
    (Narayanan et al., SC'21, takeaway 2: a model-parallel size t · p at which the model fits,
    data parallelism for the rest). The others fit only by sharding weights over "dp" as well,
    gathered again for every microbatch, slow plans that a time budget could otherwise end the
    search at."""
    params = parameter_nodes(traced.gm)
    if not params:
        return cands
    state = training_state_bytes(param_numel(traced.gm), params[0].meta["val"].dtype, opts.optimizer, opts.precision)

    def spills(cand) -> bool:
        return state / (cand.pp * model_parallel_size(cand.sub)) > budget_bytes(cand, opts)
    return sorted(cands, key=spills)


def fit_refusal(traced, cand, opts) -> PipelineRequestError | None:
    """Why AUTO need not solve this candidate, or None when it may fit (``memory_floor``; a named
    pipeline is solved all the same, for its error's memory breakdown):

    * its training state alone, every parameter split as finely as the sub-mesh allows, is over
      pp x the cap (``state_floor``); or
    * no cut fits by the units' floors (``unit_floors``: state as above, saved activations under the
      candidate's recomputation split over every device of the sub-mesh) at any schedule and
      microbatch count (and, interleaved, v): ``inter_op.least_stage_memory`` over its budget. A count m
      is skipped where another m' of the schedule holds at most as many activations in flight on
      every stage (``in_flight(m') / m' <= in_flight(m) / m``: activations scale as 1 / m).
    Both are lower bounds on what ``partition_stages`` charges, so a refused candidate has no
    partition that fits."""
    budget, sub = budget_bytes(cand, opts), dict(zip(cand.sub.axis_names, cand.sub.shape))
    floor = state_floor(traced, cand.sub.shape, opts.optimizer, opts.precision) / cand.pp
    if floor > budget:
        return PipelineRequestError(
            f"the training state alone needs at least {floor / 2**30:.2f} GiB per pipeline rank, over the "
            f"{budget / 2**30:.2f} GiB cap (every parameter split as finely as the {sub} sub-mesh allows, the model "
            f"over {cand.pp} stages): use more pipeline stages, wider tensor parallelism or more devices")
    units, ends = assign_units(traced.gm)[0], assign_units(traced.gm, ends=True)[0]
    dp = cand.sub.shape[cand.sub.axis_names.index("dp")] if "dp" in cand.sub.axis_names else 1
    batch = traced.batch_size
    state, acts = unit_floors(traced, units, cand.sub.shape, opts.optimizer, opts.precision, opts.recompute,
                              dropout_mask_bytes_for(mesh_device(cand.sub).name))
    least, floors = math.inf, {len(units): (units, state, acts)}

    def rows(v, m):     # v x pp over the layers: each end unit may be a model stage (``end_units``)
        key = len(ends) if v is not None and cand.pp * v > len(units) else len(units)
        if key not in floors:
            floors[key] = (ends, *unit_floors(traced, ends, cand.sub.shape, opts.optimizer, opts.precision,
                                              opts.recompute, dropout_mask_bytes_for(mesh_device(cand.sub).name)))
        us, st_, ac = floors[key]
        return [LayerProfile(u.name, 0.0, 0.0, st, a * (batch // m) / batch, 0.0) for u, st, a in zip(us, st_, ac)]
    for schedule in schedules(opts, cand.pp, len(ends), len(units)):
        counts = [m for m in microbatch_counts(batch, dp, opts)
                  if schedule != "interleaved_1f1b" or m % cand.pp == 0]
        for m in undominated(counts, schedule, cand.pp):
            vs = virtual_stage_choices(cand.pp, m, len(ends), opts.virtual_stages) \
                if schedule == "interleaved_1f1b" else [None]
            for v in vs:
                peak, share = least_stage_memory(rows(v, m), cand.pp, m, schedule, v)
                if peak <= budget / share:
                    return None
                least = min(least, peak * share)
    return PipelineRequestError(
        f"no stage cut fits at any schedule or microbatch count: even with every parameter split as finely as the "
        f"{sub} sub-mesh allows and every activation over all its {cand.sub.size} devices, the fullest of "
        f"{cand.pp} pipeline ranks needs at least {least / 2**30:.2f} GiB (recompute {opts.recompute or 'none'}), "
        f"over the {budget / 2**30:.2f} GiB cap: use more pipeline stages, recompute activations or more devices")


def undominated(counts: list[int], schedule: str, pp: int) -> list[int]:
    """The microbatch counts whose in-flight activations (``held``) no other count of the schedule
    undercuts on every stage (of equal ones, the largest count)."""
    return [m for m in counts
            if not any(o != m and holds_more(schedule, pp, m, o)
                       and (held(schedule, pp, m) != held(schedule, pp, o) or o > m) for o in counts)]
