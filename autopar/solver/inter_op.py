"""Inter-op parallelism: cut a sequence of layers into pipeline stages (Alpa's inter-op DP).

Input: ``L`` layers in order (``LayerProfile``: forward/backward seconds for one microbatch on one
stage's sub-mesh, state bytes, saved-activation bytes per microbatch, bytes sent onwards), ``p``
pipeline ranks, ``m`` microbatches, a schedule; ``S = p * v`` stages when interleaved (stage ``s``
on rank ``s % p``), else ``S = p``. Variables: cut points ``0 = c_0 < ... < c_S = L``.

Stage time (``_StageTables``): t_s = sum of its layers' (fwd + bwd) + 2 * hop(c_{s+1}) for s < S - 1,
hop(c) = latency + out_bytes[c - 1] / bandwidth.

Objective (``_solve_dp``): minimise T = sum_s t_s + (m - 1) * max_s t_s (Alpa's estimate). The max
is handled by enumerating the bound ``t_max`` over the distinct stage times and, for each, the
additive DP
    f[0][0] = 0,  f[s+1][l] = min_{k < l, stage [k,l) allowed at s} f[s][k] + t[k, l],
    T(t_max) = f[S][L] + (m - 1) * t_max,
from the least feasible ``t_max`` until the lower bound reaches the best T. That ``t_max`` is the
bottleneck optimum g[S][L], g[s+1][l] = min_k max(g[s][k], t[k, l]) (one DP pass, ``_least_max``). The
reported ``step_time`` is the simulated critical path of the real schedule (``schedule.simulate``).

Constraints (``_StageTables``, ``_validate``): stage memory = params + max(in_flight[s] *
activations, after) <= budget / v, ``in_flight`` read from the schedule's order. With v > 1 a
rank's peak is checked, not each stage's (``interleaved_memory``): the DP first charges each stage
its live microbatches at its rank's peak under per-stage budgets that sum to the rank's, and keeps
the partition if its exact rank peaks fit; the per-stage bound above is the fallback; user-fixed cuts
are cut points; every stage holds >= 1 layer; no idle stage (no parameters) where a partition
without one exists, else ``allow_idle`` decides (``idle_stages`` or ``IdleStageError``).

``choose_microbatches`` runs the partition for every count dividing the batch and keeps the
smallest simulated step. The derivations in full: docs/solver.md.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from autopar.schedules.schedule import compiled_schedule, simulate
from autopar.solver.interleaved_memory import rank_charges, rank_peaks, stage_budgets
from autopar.schedules.schedule import in_flight as schedule_in_flight

GIB = float(1 << 30)


@dataclass
class LayerProfile:
    name: str
    fwd: float
    bwd: float
    param_bytes: float
    activation_bytes: float
    out_bytes: float
    after_bytes: float = 0.0    # held only after the schedule, beside the state (not the activations)


@dataclass
class StagePlan:
    layers: tuple[int, int]  # [start, end)
    fwd: float
    bwd: float
    memory: float
    rank: int
    send_time: float  # p2p seconds to the next stage (0 for the last)


@dataclass
class PipelinePartition:
    stages: list[StagePlan]
    microbatches: int
    schedule: str
    step_time: float  # simulated critical path
    bubble_fraction: float
    objective: float  # the DP's estimate sum_s t_s + (m - 1) max_s t_s
    num_ranks: int
    virtual_stages: int = 1
    rank_memory: list[float] = field(default_factory=list)
    idle_stages: list[int] = field(default_factory=list)   # stages holding no parameters (none when avoidable)

    @property
    def boundaries(self) -> list[int]:
        return [s.layers[0] for s in self.stages[1:]]


@dataclass
class _StageTables:
    """Per candidate stage ``[k, l)``: time ``time[k, l]`` and per stage index ``s`` whether allowed."""
    time: np.ndarray  # [L+1, L+1], inf where k >= l
    memory: np.ndarray  # [S, L+1, L+1]
    structural: np.ndarray  # [L+1, L+1] bool: k < l and no fixed cut strictly inside
    allowed: np.ndarray  # [S, L+1, L+1] bool: structural and the memory fits
    hop: np.ndarray  # [L+1] p2p seconds when a stage ends after layer l-1
    compute_total: float
    working: np.ndarray | None = None  # [L+1, L+1] bool: stage [k, l) holds parameters


@dataclass(frozen=True)
class CutRules:
    """What the caller fixes about the cuts: ``fixed`` cut points (unit indices every partition cuts
    at, e.g. from ``pipeline_stage`` tags) and whether a stage may hold no parameters when no
    partition avoids it (``allow_idle``; else ``IdleStageError``); ``virtual_stages``: stages per rank
    under "interleaved_1f1b" when the caller fixes it (None: 2 here; ``pipeline_search`` tries several,
    ``virtual_stages.virtual_stage_choices``); ``joined``: cut points no partition cuts at (an end unit
    kept with its layer, ``cut_points.end_cuts``)."""
    fixed: Sequence[int] = ()
    allow_idle: bool = True
    virtual_stages: int | None = None
    joined: Sequence[int] = ()


class IdleStageError(ValueError):
    """Every partition that fits leaves some stage without parameters (and ``allow_idle`` is off)."""


def _without_idle(tables: _StageTables) -> _StageTables:
    """``tables`` with the stages that hold no parameters ruled out."""
    return replace(tables, allowed=tables.allowed & tables.working[None])


def _validate(layers: Sequence[LayerProfile], num_stages: int, microbatches: int, total_stages: int,
              fixed_boundaries: Sequence[int], joined: Sequence[int] = ()) -> None:
    if not layers:
        raise ValueError("partition_stages needs at least one layer")
    if num_stages < 1 or microbatches < 1:
        raise ValueError(f"num_stages and microbatches must be >= 1 (got {num_stages}, {microbatches})")
    cuttable = len(layers) - len(set(joined))
    if total_stages > cuttable:
        raise ValueError(
            f"cannot split {cuttable} layers into {total_stages} stages: every stage needs at least one "
            f"layer; use at most {cuttable} stages or expose more cut points (finer layers)")
    bad = [b for b in fixed_boundaries if not 0 < b < len(layers)]
    if bad:
        raise ValueError(f"fixed boundaries {bad} are outside (0, {len(layers)}): a cut must fall between layers")
    if len(set(fixed_boundaries)) > total_stages - 1:
        raise ValueError(
            f"{len(set(fixed_boundaries))} fixed boundaries need at least {len(set(fixed_boundaries)) + 1} stages, "
            f"got {total_stages}")


def _stage_tables(layers: Sequence[LayerProfile], in_flight: Sequence[int], budget: float | None,
                  p2p_link: tuple[float, float] | None, fixed_boundaries: Sequence[int],
                  joined: Sequence[int] = ()) -> _StageTables:
    n = len(layers)
    prefix = lambda xs: np.concatenate([[0.0], np.cumsum(np.asarray(xs, dtype=float))])  # noqa: E731
    compute = prefix([x.fwd + x.bwd for x in layers])
    params = prefix([x.param_bytes for x in layers])
    acts = prefix([x.activation_bytes for x in layers])
    after = prefix([x.after_bytes for x in layers])
    hop = np.zeros(n + 1)
    if p2p_link is not None:
        bandwidth, latency = p2p_link
        hop[1:n] = [latency + layers[l - 1].out_bytes / bandwidth for l in range(1, n)]
    k, l = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    valid = k < l
    time = np.where(valid, compute[l] - compute[k] + 2 * hop[l], np.inf)
    in_flight_arr = np.asarray(in_flight, dtype=float)[:, None, None]
    memory = (params[l] - params[k])[None] + np.maximum(in_flight_arr * (acts[l] - acts[k])[None],
                                                         (after[l] - after[k])[None])
    for b in fixed_boundaries:
        valid &= ~((k < b) & (b < l))
    for b in joined:
        valid &= (k != b) & (l != b)
    allowed = valid[None] & (memory <= (np.inf if budget is None else budget))
    return _StageTables(time, memory, valid, allowed, hop, float(compute[-1]), params[l] - params[k] > 0)


def _best_sum(tables: _StageTables, mask: np.ndarray) -> tuple[float, list[int]]:
    """min_{partition} sum_s t_s over stages allowed by ``mask`` [S, L+1, L+1]; returns (sum, cuts)."""
    num_stages, size = mask.shape[0], mask.shape[1]
    f = np.full(size, np.inf)
    f[0] = 0.0
    choices = []
    for s in range(num_stages):
        cand = f[:, None] + np.where(mask[s], tables.time, np.inf)
        choices.append(np.argmin(cand, axis=0))
        f = cand[choices[-1], np.arange(size)]
    if not np.isfinite(f[-1]):
        return np.inf, []
    cuts = [size - 1]
    for s in reversed(range(num_stages)):
        cuts.append(int(choices[s][cuts[-1]]))
    return float(f[-1]), cuts[::-1]


def _solve_dp(tables: _StageTables, microbatches: int) -> tuple[float, list[int]]:
    """Alpa's enumeration of t_max around the additive DP (module docstring)."""
    feasible_any = tables.allowed.any(axis=0)
    candidates = np.unique(tables.time[feasible_any])
    if microbatches == 1:
        candidates = candidates[-1:]
    best, best_cuts = np.inf, []
    for t_max in candidates[_first_feasible(tables, candidates):]:
        if tables.compute_total + (microbatches - 1) * t_max >= best:
            break
        total, cuts = _best_sum(tables, tables.allowed & (tables.time <= t_max)[None])
        if cuts:
            objective = _objective(tables, cuts, microbatches)
            if objective < best:
                best, best_cuts = objective, cuts
    return best, best_cuts


def _first_feasible(tables: _StageTables, candidates: np.ndarray) -> int:
    """Index of the smallest ``t_max`` in ``candidates`` under which some partition exists;
    ``len(candidates)`` when none is feasible. That ``t_max`` is the bottleneck optimum
    min_{partition} max_s t_s over the allowed stages (``_least_max``), itself a stage time of the
    tables and so one of ``candidates``."""
    least = _least_max(tables)
    return len(candidates) if not np.isfinite(least) else int(np.searchsorted(candidates, least, side="left"))


def _least_max(tables: _StageTables) -> float:
    """min_{partition} max_s t_s over the stages ``tables.allowed`` admits (inf when none): ``_best_sum``'s DP
    with max for +, g_s(l) = min_k max(g_{s-1}(k), t(k, l))."""
    mask = tables.allowed
    size = mask.shape[1]
    g = np.full(size, np.inf)
    g[0] = 0.0
    for s in range(mask.shape[0]):
        g = np.maximum(g[:, None], np.where(mask[s], tables.time, np.inf)).min(axis=0)
    return float(g[-1])


def _objective(tables: _StageTables, cuts: Sequence[int], microbatches: int) -> float:
    times = [tables.time[a, b] for a, b in zip(cuts, cuts[1:])]
    return float(sum(times) + (microbatches - 1) * max(times))


class StageMemoryError(ValueError):
    """No partition fits the memory budget. ``state`` and ``activations``: bytes of the fullest stage of
    the partition with the least peak (the smallest the model can be cut to), times ``share`` (the
    stages a rank holds), so that they compare with the per-device budget."""

    def __init__(self, message: str, state: float, activations: float, share: int):
        super().__init__(message)
        self.state, self.activations, self.share = state, activations, share


def _min_peak_partition(tables: _StageTables) -> tuple[float, list[int]]:
    """Smallest achievable max stage memory ignoring the budget (a minimax DP) and its cuts, for error messages."""
    num_stages, size = tables.memory.shape[0], tables.memory.shape[1]
    g = np.full(size, np.inf)
    g[0] = 0.0
    choices = []
    for s in range(num_stages):
        cand = np.where(tables.structural, np.maximum(g[:, None], tables.memory[s]), np.inf)
        choices.append(np.argmin(cand, axis=0))
        g = cand.min(axis=0)
    if not np.isfinite(g[-1]):
        return float(g[-1]), []
    cuts = [size - 1]
    for s in reversed(range(num_stages)):
        cuts.append(int(choices[s][cuts[-1]]))
    return float(g[-1]), cuts[::-1]


def _infeasible(layers: Sequence[LayerProfile], tables: _StageTables, budget: float, share: int, schedule: str,
                num_stages: int) -> StageMemoryError:
    peak, cuts = _min_peak_partition(tables)
    per = (f"budget / {share} virtual stages = {budget / share / GIB:.2f} GiB (and no cut found whose ranks' peaks fit "
           f"{budget / GIB:.2f} GiB together)" if share > 1 else f"budget {budget / GIB:.2f} GiB")
    hint = "the '1f1b' schedule (fewer microbatches in flight than 'gpipe'), " if schedule == "gpipe" else ""
    state = activations = 0.0
    if cuts:
        s, (a, b) = max(enumerate(zip(cuts, cuts[1:])), key=lambda x: tables.memory[x[0], x[1][0], x[1][1]])
        state = sum(x.param_bytes for x in layers[a:b])
        activations = float(tables.memory[s, a, b]) - state
    return StageMemoryError(
        f"no partition into {num_stages} stages fits memory: the smallest achievable peak stage memory is "
        f"{peak / GIB:.2f} GiB but each stage may use {per} (schedule {schedule!r}). Use more pipeline stages "
        f"or devices, {hint}activation checkpointing, sharding within stages (tensor/ZeRO), or a larger budget",
        state * share, activations * share, share)


def _build_partition(layers: Sequence[LayerProfile], tables: _StageTables, cuts: Sequence[int], objective: float,
                     num_ranks: int, microbatches: int, schedule: str, virtual_stages: int) -> PipelinePartition:
    """The partition at ``cuts``, simulated under its schedule."""
    sched, program = compiled_schedule(schedule, num_ranks, microbatches, virtual_stages)
    stages = []
    for s, (a, b) in enumerate(zip(cuts, cuts[1:])):
        fwd = sum(x.fwd for x in layers[a:b])
        bwd = sum(x.bwd for x in layers[a:b])
        stages.append(StagePlan((a, b), fwd, bwd, float(tables.memory[s, a, b]), sched.rank_of(s), float(tables.hop[b])))
    sim = simulate(sched, [s.fwd for s in stages], [s.bwd for s in stages], [s.send_time for s in stages[:-1]],
                   program=program)
    rank_memory = [sum(s.memory for s in stages if s.rank == r) for r in range(num_ranks)]
    if virtual_stages > 1:          # a rank's stages peak at different times (``interleaved_memory``)
        spans = list(zip(cuts, cuts[1:]))
        rank_memory = rank_peaks(sched, [sum(x.param_bytes for x in layers[a:b]) for a, b in spans],
                                 [sum(x.activation_bytes for x in layers[a:b]) for a, b in spans],
                                 [sum(x.after_bytes for x in layers[a:b]) for a, b in spans])
    idle = [s for s, (a, b) in enumerate(zip(cuts, cuts[1:])) if not tables.working[a, b]]
    return PipelinePartition(stages, microbatches, schedule, sim.step_time, sim.bubble_fraction, objective,
                             num_ranks, virtual_stages, rank_memory, idle)


def _solve_avoiding_idle(layers, tables: _StageTables, solve, allow_idle: bool, total: int):
    """(objective, cuts) by ``solve(tables)``, first without idle stages, then (``allow_idle``) with them."""
    objective, cuts = solve(_without_idle(tables))
    if cuts:
        return objective, cuts
    objective, cuts = solve(tables)
    if cuts and not allow_idle:
        idle = [f"stage {s} ({', '.join(x.name for x in layers[a:b])})" for s, (a, b) in enumerate(zip(cuts, cuts[1:]))
                if not tables.working[a, b]]
        raise IdleStageError(f"every partition into {total} stages that fits leaves a stage without parameters "
                             f"({'; '.join(idle)}): its rank would have nothing to train; use fewer stages")
    return objective, cuts


def _prepare(layers, num_stages, microbatches, schedule, memory_budget, p2p_link, cuts: CutRules, virtual_stages):
    virtual_stages = virtual_stages or (2 if schedule == "interleaved_1f1b" else 1)
    fixed = sorted(set(cuts.fixed))
    total = num_stages * virtual_stages
    _validate(layers, num_stages, microbatches, total, fixed, cuts.joined)
    held = schedule_in_flight(schedule, num_stages, microbatches, virtual_stages)
    budget = None if memory_budget is None else memory_budget / virtual_stages
    return _stage_tables(layers, held, budget, p2p_link, fixed, cuts.joined), virtual_stages


def _rank_tables(layers, num_stages, microbatches, schedule, memory_budget, p2p_link, cuts: CutRules,
                 v: int) -> list[_StageTables]:
    """Tables charging each stage its live microbatches at its rank's peak (``rank_charges``), under
    each of ``stage_budgets`` (one unbudgeted table when there is no budget)."""
    charges = rank_charges(schedule, num_stages, microbatches, v)
    base = _stage_tables(layers, charges, None, p2p_link, sorted(set(cuts.fixed)), cuts.joined)
    if memory_budget is None:
        return [base]
    n, total = len(layers), num_stages * v
    least = base.memory[:, np.arange(n), np.arange(n) + 1].min(axis=1)     # one unit per stage
    state, acts = sum(x.param_bytes for x in layers) / total, sum(x.activation_bytes for x in layers) / total
    even = state + np.asarray(charges, dtype=float) * acts
    return [replace(base, allowed=base.structural[None] & (base.memory <= b[:, None, None]))
            for b in stage_budgets(num_stages, v, memory_budget, least, even)]


def partition_stages(layers: Sequence[LayerProfile], num_stages: int, microbatches: int, schedule: str = "1f1b",
                     memory_budget: float | None = None, p2p_link: tuple[float, float] | None = None,
                     rules: CutRules = CutRules(), virtual_stages: int | None = None) -> PipelinePartition:
    """Optimal contiguous stage partition (module docstring). ``p2p_link`` = (bytes/s, seconds).

    ``num_stages`` is the number of pipeline ranks; ``virtual_stages`` (default 2 for
    "interleaved_1f1b", else 1) stages per rank; ``rules``: fixed cut points, idle stages allowed.
    Raises ValueError when no partition fits, and ``IdleStageError`` when only partitions with a
    parameterless stage fit and ``rules.allow_idle`` is off.
    """
    return _partition_by(lambda t: _solve_dp(t, microbatches), layers, num_stages, microbatches, schedule,
                         memory_budget, p2p_link, replace(rules, virtual_stages=virtual_stages or rules.virtual_stages))


def _partition_by(solve, layers, num_stages, microbatches, schedule, memory_budget, p2p_link,
                  rules: CutRules) -> PipelinePartition:
    """The partition ``solve(tables) -> (objective, cuts)`` picks: with several stages per rank, the
    first of ``_rank_tables`` whose partition's rank peaks fit (no idle stage), else the tables
    bounding each stage by budget / v (``rules.virtual_stages``)."""
    tables, v = _prepare(layers, num_stages, microbatches, schedule, memory_budget, p2p_link, rules,
                         rules.virtual_stages)
    if v > 1:
        for relaxed in _rank_tables(layers, num_stages, microbatches, schedule, memory_budget, p2p_link, rules, v):
            objective, cuts = solve(_without_idle(relaxed))
            if cuts:
                part = _build_partition(layers, relaxed, cuts, objective, num_stages, microbatches, schedule, v)
                if memory_budget is None or max(part.rank_memory) <= memory_budget:
                    return part
    objective, cuts = _solve_avoiding_idle(layers, tables, solve, rules.allow_idle, num_stages * v)
    if not cuts:
        raise _infeasible(layers, tables, memory_budget, v, schedule, num_stages * v)
    return _build_partition(layers, tables, cuts, objective, num_stages, microbatches, schedule, v)


def least_stage_memory(layers: Sequence[LayerProfile], num_stages: int, microbatches: int,
                       schedule: str = "1f1b", virtual_stages: int | None = None) -> tuple[float, int]:
    """(the least max stage memory over every contiguous partition, ignoring time; a divisor of the
    budget): the minimax DP of the memory-error path; a partition fits only if this is <= budget /
    divisor. One stage per rank: params + in-flight x activations as ``partition_stages`` charges
    them, divisor 1. Several: each stage charged its live microbatches at its rank's peak (no more
    than any table of ``partition_stages`` charges), and a stage may take up to the whole budget,
    divisor 1 (a lower bound: the rank's other stages are not counted)."""
    tables, v = _prepare(layers, num_stages, microbatches, schedule, None, None, CutRules(), virtual_stages)
    if v > 1:
        tables = _rank_tables(layers, num_stages, microbatches, schedule, None, None, CutRules(), v)[0]
    return _min_peak_partition(tables)[0], 1


def brute_force_partition(layers: Sequence[LayerProfile], num_stages: int, microbatches: int, schedule: str = "1f1b",
                          memory_budget: float | None = None, p2p_link: tuple[float, float] | None = None,
                          rules: CutRules = CutRules(), virtual_stages: int | None = None) -> PipelinePartition:
    """Same contract as ``partition_stages`` by enumerating every cut set (tests, small inputs only)."""
    n = len(layers)

    def enumerate_cuts(t: _StageTables):
        total = t.memory.shape[0]
        best, best_cuts = np.inf, []
        for inner in itertools.combinations(range(1, n), total - 1):
            cuts = [0, *inner, n]
            if all(t.allowed[s, a, b] for s, (a, b) in enumerate(zip(cuts, cuts[1:]))):
                objective = _objective(t, cuts, microbatches)
                if objective < best:
                    best, best_cuts = objective, cuts
        return best, best_cuts

    return _partition_by(enumerate_cuts, layers, num_stages, microbatches, schedule, memory_budget, p2p_link,
                         replace(rules, virtual_stages=virtual_stages or rules.virtual_stages))


def scale_profile(layers: Sequence[LayerProfile], factor: float) -> list[LayerProfile]:
    """Per-microbatch profile for a microbatch ``factor`` times the profiled one (linear in batch)."""
    return [replace(x, fwd=x.fwd * factor, bwd=x.bwd * factor, activation_bytes=x.activation_bytes * factor,
                    out_bytes=x.out_bytes * factor) for x in layers]


def choose_microbatches(batch_size: int, layers: Sequence[LayerProfile] | Callable[[int], Sequence[LayerProfile]],
                        num_stages: int, candidates: Sequence[int] | None = None, schedule: str = "1f1b",
                        **partition_kwargs) -> PipelinePartition:
    """Best partition over microbatch counts ``m`` dividing ``batch_size`` (smallest simulated step time).

    ``layers`` is either a callable ``microbatch_size -> profiles`` or profiles measured on the
    whole batch, scaled linearly to ``batch_size / m`` (p2p latency does not shrink, which is
    what makes very many tiny microbatches lose). ``candidates`` defaults to all divisors.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    divisors = [m for m in range(1, batch_size + 1) if batch_size % m == 0]
    if candidates is None:
        candidates = divisors
    bad = [m for m in candidates if m < 1 or batch_size % m]
    if bad:
        raise ValueError(
            f"microbatch counts {bad} do not divide the batch size {batch_size}; every microbatch must hold the "
            f"same number of samples. Valid counts: {divisors}")
    profile = layers if callable(layers) else (lambda size: scale_profile(layers, size / batch_size))
    best, reasons = None, []
    for m in candidates:
        try:
            plan = partition_stages(profile(batch_size // m), num_stages, m, schedule, **partition_kwargs)
        except ValueError as err:
            reasons.append(f"m={m}: {err}")
            continue
        if best is None or plan.step_time < best.step_time:
            best = plan
    if best is None:
        raise ValueError("no microbatch count gives a feasible pipeline:\n" + "\n".join(reasons))
    return best
