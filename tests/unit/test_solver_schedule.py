"""Pipeline schedules as data: completeness, dependencies, step times, in-flight bounds, printing."""
import pytest

from autopar.schedules.schedule import Action, build_schedule, simulate

CASES = [("gpipe", p, m, 1) for p in (1, 2, 4) for m in (1, 3, 8)] + \
        [("1f1b", p, m, 1) for p in (1, 2, 4) for m in (1, 3, 8)] + \
        [("interleaved_1f1b", p, m, v) for p in (2, 4) for m in (4, 8) for v in (2, 3)]


@pytest.mark.parametrize("kind,p,m,v", CASES)
def test_every_action_once_and_dependencies_hold(kind, p, m, v):
    sched = build_schedule(kind, p, m, v)
    actions = [a for rank in sched.actions for a in rank]
    assert len(actions) == len(set(actions)) == 2 * sched.num_stages * m
    fwd = [1.0 + 0.1 * s for s in range(sched.num_stages)]
    bwd = [2.0 + 0.3 * s for s in range(sched.num_stages)]
    hop = 0.25
    sim = simulate(sched, fwd, bwd, hop)
    start, end = sim.start_times, sim.end_times
    for a in actions:
        s, i = a.stage, a.microbatch
        delay = lambda other: 0.0 if sched.rank_of(other) == sched.rank_of(s) else hop  # noqa: E731
        if a.kind == "F" and s > 0:
            assert start[a] >= end[Action("F", s - 1, i)] + delay(s - 1) - 1e-12
        if a.kind == "B":
            assert start[a] >= end[Action("F", s, i)] - 1e-12
            if s < sched.num_stages - 1:
                assert start[a] >= end[Action("B", s + 1, i)] + delay(s + 1) - 1e-12
    for rank in sched.actions:  # one action at a time, in list order
        for a, b in zip(rank, rank[1:]):
            assert start[b] >= end[a] - 1e-12


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 4), (4, 4), (4, 8), (3, 7)])
def test_equal_stages_step_time(kind, p, m):
    f, b = 1.5, 2.5
    sim = simulate(build_schedule(kind, p, m), f, b, 0.0)
    assert sim.step_time == pytest.approx((m + p - 1) * (f + b))
    assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert sim.per_rank_busy == pytest.approx([m * (f + b)] * p)


@pytest.mark.parametrize("p,m", [(2, 8), (4, 4), (4, 16), (8, 3)])
def test_in_flight_bounds(p, m):
    assert build_schedule("gpipe", p, m).in_flight() == [m] * p
    in_flight = build_schedule("1f1b", p, m).in_flight()
    assert in_flight == [min(p - s, m) for s in range(p)]
    assert max(in_flight) <= p


def test_interleaved_reduces_bubble():
    p, m, v = 4, 8, 2
    plain = simulate(build_schedule("1f1b", p, m), 1.0, 2.0)
    inter = simulate(build_schedule("interleaved_1f1b", p, m, v), 1.0 / v, 2.0 / v)
    assert inter.bubble_fraction < plain.bubble_fraction
    assert inter.step_time < plain.step_time
    assert inter.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


def test_grid_and_str():
    sched = build_schedule("1f1b", 2, 2)
    grid = sched.grid()
    assert grid[0] == ["0F0", "."]
    assert grid[1] == ["0F1", "1F0"]
    assert grid[2] == [".", "1B0"] and grid[3] == [".", "1B0"]
    assert len(grid) == (2 + 2 - 1) * 3
    text = str(sched)
    assert "1F0" in text and "r1" in text and len(text.splitlines()) == len(grid) + 2


def test_errors():
    with pytest.raises(ValueError, match="unknown schedule"):
        build_schedule("zigzag", 2, 2)
    with pytest.raises(ValueError, match="divisible"):
        build_schedule("interleaved_1f1b", 4, 6, 2)
    with pytest.raises(ValueError, match="interleaved"):
        build_schedule("1f1b", 4, 8, 2)
    with pytest.raises(ValueError, match="integer"):
        build_schedule("1f1b", 2, 2).grid(fwd=0.5)
    broken = build_schedule("1f1b", 2, 2)
    broken.actions[0] = broken.actions[0][::-1]  # B before F on rank 0 with F first needed downstream
    with pytest.raises(ValueError, match="deadlock"):
        simulate(broken, 1.0, 2.0)


def test_in_flight_without_building_the_schedule_is_the_built_one():
    """``schedule.in_flight``: the counts the built action orders give, for every kind."""
    from autopar.schedules.schedule import in_flight

    for kind in ("gpipe", "1f1b", "interleaved_1f1b"):
        for p in range(1, 6):
            for m in range(1, 13):
                for v in ((1, 2) if kind == "interleaved_1f1b" else (1,)):
                    if v > 1 and m % p:
                        continue
                    assert in_flight(kind, p, m, v) == tuple(build_schedule(kind, p, m, v).in_flight()), (kind, p, m, v)


def test_a_compiled_schedule_simulates_as_the_schedule():
    """``compiled_schedule``'s shared program gives ``simulate`` the same times as the schedule alone
    (uneven stage times and per-boundary delays, every kind)."""
    from autopar.schedules.schedule import compiled_schedule

    for kind, p, m, v in (("gpipe", 3, 5, 1), ("1f1b", 4, 7, 1), ("interleaved_1f1b", 2, 4, 3)):
        n = p * v
        f = [0.1 + 0.03 * s for s in range(n)]
        b = [0.25 - 0.01 * s for s in range(n)]
        hops = [0.002 * (s + 1) for s in range(n - 1)]
        sched, program = compiled_schedule(kind, p, m, v)
        fast = simulate(sched, f, b, hops, program=program)
        plain = simulate(build_schedule(kind, p, m, v), f, b, hops)
        assert fast.step_time == plain.step_time and fast.per_rank_busy == plain.per_rank_busy
        assert fast.start_times == plain.start_times and fast.end_times == plain.end_times
        assert compiled_schedule(kind, p, m, v)[1] is program


def test_compiled_schedules_kept_within_their_action_budget(monkeypatch):
    """``compiled_schedule`` keeps the most recent shapes up to ``KEPT_ACTIONS`` actions; a bigger one is
    built each time and not kept."""
    from collections import OrderedDict

    from autopar.schedules import schedule as sch

    monkeypatch.setattr(sch, "_COMPILED", OrderedDict())
    monkeypatch.setattr(sch, "KEPT_ACTIONS", 100)
    first = sch.compiled_schedule("1f1b", 2, 8)          # 32 actions
    assert sch.compiled_schedule("1f1b", 2, 8) is first
    sch.compiled_schedule("gpipe", 2, 10)                # 40: both kept (72)
    sch.compiled_schedule("1f1b", 3, 8)                  # 48: the oldest goes (88)
    assert list(sch._COMPILED) == [("gpipe", 2, 10, 1), ("1f1b", 3, 8, 1)]
    big = sch.compiled_schedule("1f1b", 4, 20)           # 160 > 100: not kept
    assert ("1f1b", 4, 20, 1) not in sch._COMPILED and sch.compiled_schedule("1f1b", 4, 20) is not big
