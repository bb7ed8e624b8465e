"""Pipeline schedules as data, and an event-driven simulator of their critical path.

A schedule is, for each pipeline rank, the ordered list of actions that rank runs:
``Action("F", stage, mb)`` is the forward of model stage ``stage`` on microbatch ``mb``,
``Action("B", stage, mb)`` its backward. Nothing here runs a model; the runtime and the
inter-op solver both read the same data.

Stages and ranks
    ``build_schedule(kind, num_stages, microbatches, virtual_stages)`` takes ``num_stages``
    pipeline ranks ``p``. For "gpipe" and "1f1b" model stage ``s`` runs on rank ``s``. For
    "interleaved_1f1b" the model is cut into ``p * v`` stages (``v = virtual_stages``) and
    stage ``s`` runs on rank ``s % p`` (Megatron-LM's virtual pipeline).

Action orders (per rank ``r``, ``m`` microbatches)
    gpipe             F0 .. F(m-1), then B0 .. B(m-1)                    (``_gpipe_order``)
    1f1b              ``w = min(p - r - 1, m)`` warm-up forwards, then alternate one forward
                      and one backward, then drain the remaining backwards  (``_one_f_one_b_order``)
    interleaved_1f1b  Megatron's order over ``m * v`` virtual microbatches: forward ``k``
                      runs chunk ``(k mod pv) // p`` on microbatch ``(k // pv) * p + k mod p``,
                      backward ``k`` runs chunk ``v - 1 - (k mod pv) // p``; warm-up
                      ``min(2 (p - r - 1) + (v - 1) p, m v)``; requires ``m % p == 0``
                      (``_interleaved_order``)

Simulation (``simulate``)
    Each action starts at the latest of: its rank is free (actions on a rank run in list
    order, one at a time) and its data dependencies are done:
        F(s, i) after F(s-1, i) ends (+ p2p[s-1] when the two stages are on different ranks)
        B(s, i) after B(s+1, i) ends (+ p2p[s] when on different ranks)
        B(s, i) after F(s, i) ends (this is the only dependency of the last stage's B)
    ``step_time`` is the end of the last action; ``bubble_fraction`` is the idle share of
    ``num_ranks * step_time``. A schedule whose orders deadlock raises ValueError.
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

SCHEDULE_KINDS = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass(frozen=True)
class Action:
    kind: str  # "F" or "B"
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass
class SimResult:
    step_time: float
    bubble_fraction: float
    per_rank_busy: list[float]
    start_times: dict[Action, float]
    end_times: dict[Action, float] = field(default_factory=dict)


@dataclass
class Schedule:
    kind: str
    num_ranks: int
    microbatches: int
    virtual_stages: int
    actions: list[list[Action]]  # per rank, in execution order

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.virtual_stages

    def rank_of(self, stage: int) -> int:
        return stage % self.num_ranks

    def in_flight(self) -> list[int]:
        """Per stage, the most microbatches whose forward ran and backward has not yet."""
        live = [0] * self.num_stages
        peak = [0] * self.num_stages
        for rank_actions in self.actions:
            for a in rank_actions:
                live[a.stage] += 1 if a.kind == "F" else -1
                peak[a.stage] = max(peak[a.stage], live[a.stage])
        return peak

    def grid(self, fwd: float | Sequence[float] = 1, bwd: float | Sequence[float] = 2) -> list[list[str]]:
        """Step x rank table of cells like ``1F0``; ``.`` where a rank idles. Integer times only."""
        fwd_t, bwd_t = _per_stage(fwd, self.num_stages), _per_stage(bwd, self.num_stages)
        if any(t != int(t) or t <= 0 for t in fwd_t + bwd_t):
            raise ValueError("grid() needs positive integer action times (one row per time unit)")
        sim = simulate(self, fwd_t, bwd_t, 0.0)
        rows = [["."] * self.num_ranks for _ in range(int(round(sim.step_time)))]
        for a, start in sim.start_times.items():
            for t in range(int(round(start)), int(round(sim.end_times[a]))):
                rows[t][self.rank_of(a.stage)] = str(a)
        return rows

    def __str__(self) -> str:
        rows = self.grid()
        width = max(len(c) for row in rows for c in row + [f"r{self.num_ranks - 1}"])
        header = "step " + " ".join(f"r{r}".rjust(width) for r in range(self.num_ranks))
        body = [f"{t:4d} " + " ".join(c.rjust(width) for c in row) for t, row in enumerate(rows)]
        return "\n".join([f"{self.kind} p={self.num_ranks} m={self.microbatches} v={self.virtual_stages}", header] + body)


def build_schedule(kind: str, num_stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Per-rank action lists for ``kind`` on ``num_stages`` pipeline ranks (see module docstring)."""
    p, m, v = num_stages, microbatches, virtual_stages
    if kind not in SCHEDULE_KINDS:
        raise ValueError(f"unknown schedule {kind!r}; choose one of {', '.join(SCHEDULE_KINDS)}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"num_stages, microbatches and virtual_stages must be >= 1 (got {p}, {m}, {v})")
    if kind != "interleaved_1f1b" and v != 1:
        raise ValueError(f"virtual_stages={v} needs the 'interleaved_1f1b' schedule, not {kind!r}")
    if kind == "gpipe":
        actions = [_gpipe_order(r, m) for r in range(p)]
    elif kind == "1f1b" or v == 1:
        actions = [_one_f_one_b_order(r, p, m) for r in range(p)]
    else:
        if m % p:
            raise ValueError(
                f"interleaved_1f1b needs microbatches divisible by the pipeline ranks: {m} % {p} != 0; "
                f"use {((m + p - 1) // p) * p} microbatches or the '1f1b' schedule")
        actions = [_interleaved_order(r, p, m, v) for r in range(p)]
    return Schedule(kind, p, m, v, actions)


@functools.lru_cache(maxsize=4096)
def in_flight(kind: str, num_stages: int, microbatches: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """``build_schedule(...).in_flight()`` without building the actions where the orders below give
    it at once: GPipe holds every microbatch on every stage; 1F1B's stage s runs min(p - s - 1, m)
    warm-up forwards and one more before its first backward, so min(p - s, m). (The planner asks
    this for every microbatch count and stage cut, up to thousands of microbatches.) Interleaved:
    from the built schedule."""
    p, m = num_stages, microbatches
    if kind == "gpipe" and virtual_stages == 1 and p >= 1 and m >= 1:
        return (m,) * p
    if kind in ("1f1b", "interleaved_1f1b") and virtual_stages == 1 and p >= 1 and m >= 1:
        return tuple(min(p - s, m) for s in range(p))
    return tuple(build_schedule(kind, num_stages, microbatches, virtual_stages).in_flight())


def _gpipe_order(stage: int, m: int) -> list[Action]:
    return [Action("F", stage, i) for i in range(m)] + [Action("B", stage, i) for i in range(m)]


def _one_f_one_b_order(stage: int, p: int, m: int) -> list[Action]:
    warmup = min(p - stage - 1, m)
    order = [Action("F", stage, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action("F", stage, warmup + i), Action("B", stage, i)]
    order += [Action("B", stage, i) for i in range(m - warmup, m)]
    return order


def _interleaved_order(rank: int, p: int, m: int, v: int) -> list[Action]:
    total = m * v

    def forward(k: int) -> Action:
        chunk = (k % (p * v)) // p
        return Action("F", chunk * p + rank, (k // (p * v)) * p + k % p)

    def backward(k: int) -> Action:
        chunk = v - 1 - (k % (p * v)) // p
        return Action("B", chunk * p + rank, (k // (p * v)) * p + k % p)

    warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    order = [forward(k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [forward(warmup + i), backward(i)]
    order += [backward(k) for k in range(total - warmup, total)]
    return order


def _per_stage(value: float | Sequence[float], n: int) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * n
    values = [float(x) for x in value]
    if len(values) != n:
        raise ValueError(f"expected {n} per-stage values, got {len(values)}")
    return values


@dataclass(frozen=True)
class _Program:
    """A schedule's actions as integers, for ``simulate``: ``actions[i]`` is action ``i``; ``order[r]`` rank
    r's action ids in order; ``deps[i]`` the (action id, boundary) pairs action i waits for, the boundary
    of the p2p delay paid between two ranks, or -1 where both run on one rank (module docstring)."""
    actions: tuple[Action, ...]
    order: tuple[tuple[int, ...], ...]
    deps: tuple[tuple[tuple[int, int], ...], ...]


def _check_complete(schedule: Schedule) -> None:
    seen = [a for rank_actions in schedule.actions for a in rank_actions]
    expected = {Action(k, s, i) for k in "FB" for s in range(schedule.num_stages) for i in range(schedule.microbatches)}
    if len(seen) != len(set(seen)) or set(seen) != expected:
        raise ValueError("schedule must list every (F|B, stage, microbatch) exactly once")
    for r, rank_actions in enumerate(schedule.actions):
        if any(schedule.rank_of(a.stage) != r for a in rank_actions):
            raise ValueError(f"rank {r} lists an action of a stage that lives on another rank")


def _compile(schedule: Schedule) -> _Program:
    """``schedule`` checked (``_check_complete``) and numbered: each action's data dependencies,

        F(s, i) after F(s-1, i)  (+ p2p[s-1] between ranks)
        B(s, i) after F(s, i) and B(s+1, i)  (+ p2p[s] between ranks)."""
    _check_complete(schedule)
    actions = tuple(a for rank_actions in schedule.actions for a in rank_actions)
    ids = {a: i for i, a in enumerate(actions)}
    last, rank_of = schedule.num_stages - 1, schedule.rank_of

    def boundary(src: int, dst: int) -> int:
        return -1 if rank_of(src) == rank_of(dst) else min(src, dst)

    deps = []
    for a in actions:
        s, i = a.stage, a.microbatch
        if a.kind == "F":
            deps.append(((ids[Action("F", s - 1, i)], boundary(s - 1, s)),) if s > 0 else ())
        else:
            mine = [(ids[Action("F", s, i)], -1)]
            if s < last:
                mine.append((ids[Action("B", s + 1, i)], boundary(s + 1, s)))
            deps.append(tuple(mine))
    order, at = [], 0
    for rank_actions in schedule.actions:
        order.append(tuple(range(at, at + len(rank_actions))))
        at += len(rank_actions)
    return _Program(actions, tuple(order), tuple(deps))


KEPT_ACTIONS = 400_000      # ``compiled_schedule`` keeps at most this many actions' programs (~440 bytes each)
_COMPILED: OrderedDict = OrderedDict()


def compiled_schedule(kind: str, num_stages: int, microbatches: int, virtual_stages: int = 1) -> tuple[Schedule, _Program]:
    """``build_schedule(...)`` and its ``_Program``, kept for the inter-op solver, which simulates many
    partitions of one shape: the most recently used shapes up to ``KEPT_ACTIONS`` actions in all (a
    bigger one is built each time). The schedule is shared: read it, do not change it."""
    key = (kind, num_stages, microbatches, virtual_stages)
    hit = _COMPILED.get(key)
    if hit is not None:
        _COMPILED.move_to_end(key)
        return hit
    schedule = build_schedule(kind, num_stages, microbatches, virtual_stages)
    hit = schedule, _compile(schedule)
    size = len(hit[1].actions)
    if size <= KEPT_ACTIONS:
        while _COMPILED and sum(len(p.actions) for _, p in _COMPILED.values()) + size > KEPT_ACTIONS:
            _COMPILED.popitem(last=False)
        _COMPILED[key] = hit
    return hit


def simulate(schedule: Schedule, fwd: float | Sequence[float], bwd: float | Sequence[float],
             p2p: float | Sequence[float] = 0.0, program: _Program | None = None) -> SimResult:
    """Critical path of ``schedule`` with per-stage forward/backward times and p2p delays.

    ``p2p`` is one delay, or one per stage boundary (``num_stages - 1`` values, boundary
    ``s`` between stage ``s`` and ``s + 1``), paid only between different ranks. ``program``:
    ``schedule``'s own ``_Program`` when at hand (``compiled_schedule``).
    """
    prog = program or _compile(schedule)
    n = schedule.num_stages
    fwd_t, bwd_t = _per_stage(fwd, n), _per_stage(bwd, n)
    hops = _per_stage(p2p, max(n - 1, 0))
    dur = [(fwd_t if a.kind == "F" else bwd_t)[a.stage] for a in prog.actions]
    deps = [tuple((d, hops[b] if b >= 0 else 0.0) for d, b in pairs) for pairs in prog.deps]
    start: list[float] = [0.0] * len(dur)
    end: list[float | None] = [None] * len(dur)
    cursor = [0] * schedule.num_ranks
    free_at = [0.0] * schedule.num_ranks
    remaining = len(dur)
    while remaining:
        progressed = False
        for r, ids in enumerate(prog.order):
            c, t_free = cursor[r], free_at[r]
            while c < len(ids):
                a = ids[c]
                t = t_free
                for d, delay in deps[a]:
                    e = end[d]
                    if e is None:
                        break
                    if e + delay > t:
                        t = e + delay
                else:
                    start[a], t_free = t, t + dur[a]
                    end[a] = t_free
                    c += 1
                    continue
                break
            if c > cursor[r]:
                remaining -= c - cursor[r]
                cursor[r], free_at[r], progressed = c, t_free, True
        if not progressed:
            stuck = [str(prog.actions[ids[c]]) for ids, c in zip(prog.order, cursor) if c < len(ids)]
            raise ValueError(f"schedule deadlocks: every rank waits ({', '.join(stuck)})")
    step_time = max(end)
    busy = [sum(end[a] - start[a] for a in ids) for ids in prog.order]
    bubble = 1.0 - sum(busy) / (schedule.num_ranks * step_time) if step_time > 0 else 0.0
    return SimResult(step_time, bubble, busy, dict(zip(prog.actions, start)), dict(zip(prog.actions, end)))
