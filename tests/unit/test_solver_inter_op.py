"""Inter-op stage partition: DP equals brute force, balance, memory budgets, errors."""
import numpy as np
import pytest

from autopar.solver.inter_op import (
    CutRules, LayerProfile, brute_force_partition, choose_microbatches, partition_stages, scale_profile)

GIB = 2.0**30


def random_layers(rng: np.random.Generator, n: int) -> list[LayerProfile]:
    return [LayerProfile(f"l{i}", rng.uniform(0.2, 2.0), rng.uniform(0.4, 4.0), rng.uniform(0.5, 3.0) * GIB,
                         rng.uniform(0.1, 1.0) * GIB, rng.uniform(0.01, 0.5) * GIB) for i in range(n)]


@pytest.mark.parametrize("seed", range(30))
def test_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    schedule = ["gpipe", "1f1b", "interleaved_1f1b"][seed % 3]
    p = int(rng.integers(2, 5)) if schedule != "interleaved_1f1b" else 2
    n = int(rng.integers(p * (2 if schedule == "interleaved_1f1b" else 1), 9))
    layers = random_layers(rng, n)
    m = p * int(rng.integers(1, 4))
    kwargs = dict(schedule=schedule, p2p_link=(float(rng.uniform(1, 50)) * GIB, 1e-4))
    if seed % 2:
        kwargs["memory_budget"] = float(rng.uniform(4, 20)) * GIB
    if seed % 5 == 0 and n > 3:
        kwargs["rules"] = CutRules(fixed=[int(rng.integers(1, n))])
    try:
        expected = brute_force_partition(layers, p, m, **kwargs)
    except ValueError:
        with pytest.raises(ValueError):
            partition_stages(layers, p, m, **kwargs)
        return
    got = partition_stages(layers, p, m, **kwargs)
    assert got.objective == pytest.approx(expected.objective, rel=1e-12)
    stages = got.stages
    assert stages[0].layers[0] == 0 and stages[-1].layers[1] == n
    assert all(a.layers[1] == b.layers[0] for a, b in zip(stages, stages[1:]))
    assert all(s.layers[0] < s.layers[1] for s in stages)
    if "memory_budget" in kwargs:
        assert max(got.rank_memory) <= kwargs["memory_budget"]
    for b in kwargs["rules"].fixed if "rules" in kwargs else []:
        assert b in got.boundaries
    assert got.step_time > 0 and 0 <= got.bubble_fraction < 1


def uniform(n: int, param_bytes: float = GIB, act: float = 0.1 * GIB) -> list[LayerProfile]:
    return [LayerProfile(f"l{i}", 1.0, 2.0, param_bytes, act, 0.01 * GIB) for i in range(n)]


def test_uneven_layer_count_is_balanced():
    part = partition_stages(uniform(5), 2, 4)
    sizes = sorted(b - a for a, b in (s.layers for s in part.stages))
    assert sizes == [2, 3]
    assert part.step_time == pytest.approx(simulated_equal_or_better(part))


def simulated_equal_or_better(part):
    """The simulated step is never below the pipeline lower bound (m - 1) * max + sum."""
    times = [s.fwd + s.bwd for s in part.stages]
    assert part.step_time >= sum(times) + (part.microbatches - 1) * max(times) - 1e-9
    return part.step_time


def test_even_split_and_one_f_one_b_memory():
    part = partition_stages(uniform(8), 4, 8)
    assert [s.layers for s in part.stages] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # 1F1B keeps min(p - s, m) microbatches of activations on stage s
    assert [s.memory for s in part.stages] == pytest.approx([(2 + 0.2 * k) * GIB for k in (4, 3, 2, 1)])
    assert part.step_time == pytest.approx((8 + 4 - 1) * 6.0)


def test_embedding_dominated_model_fits_and_balances():
    layers = [LayerProfile("embed", 0.5, 1.0, 12 * GIB, 0.05 * GIB, 0.05 * GIB)] + uniform(11, 1 * GIB, 0.2 * GIB)
    budget = 14 * GIB
    part = partition_stages(layers, 4, 8, memory_budget=budget)
    assert max(part.rank_memory) <= budget
    assert part.stages[0].layers == (0, 1)  # the embedding stage can hold nothing else
    rest = [s.fwd + s.bwd for s in part.stages[1:]]
    assert max(rest) - min(rest) <= 3.0 + 1e-9  # the 11 other layers spread 4/4/3 (one layer = 3 s)
    unconstrained = partition_stages(layers, 4, 8)
    assert unconstrained.stages[0].layers[1] > 1  # without the budget the first stage takes more


def test_more_stages_than_layers():
    with pytest.raises(ValueError, match="cannot split 3 layers into 4 stages"):
        partition_stages(uniform(3), 4, 4)
    with pytest.raises(ValueError, match="cannot split 3 layers into 4 stages"):
        partition_stages(uniform(3), 2, 4, schedule="interleaved_1f1b", virtual_stages=2)


def test_budget_too_small_reports_smallest_peak():
    layers = uniform(4, param_bytes=2 * GIB, act=0.5 * GIB)
    with pytest.raises(ValueError) as err:
        partition_stages(layers, 2, 4, memory_budget=4 * GIB)
    # best: 2 layers per stage; stage 0 holds min(2 - 0, 4) = 2 microbatches: 4 + 2 * 1 = 6 GiB
    assert "smallest achievable peak stage memory is 6.00 GiB" in str(err.value)
    assert "budget 4.00 GiB" in str(err.value)


def test_fixed_boundaries():
    part = partition_stages(uniform(8), 2, 4, rules=CutRules(fixed=[3]))
    assert part.boundaries == [3]
    with pytest.raises(ValueError, match="outside"):
        partition_stages(uniform(8), 2, 4, rules=CutRules(fixed=[8]))
    with pytest.raises(ValueError, match="fixed boundaries need at least 3 stages"):
        partition_stages(uniform(8), 2, 4, rules=CutRules(fixed=[2, 5]))


def test_interleaved_partition_runs_on_ranks():
    part = partition_stages(uniform(8), 2, 4, schedule="interleaved_1f1b")
    assert len(part.stages) == 4 and [s.rank for s in part.stages] == [0, 1, 0, 1]
    plain = partition_stages(uniform(8), 2, 4, schedule="1f1b")
    assert part.bubble_fraction < plain.bubble_fraction


def test_choose_microbatches():
    layers = uniform(8)
    best = choose_microbatches(32, layers, 4, p2p_link=(10 * GIB, 1e-3))
    assert 32 % best.microbatches == 0
    assert best.step_time <= partition_stages(layers, 4, 1, p2p_link=(10 * GIB, 1e-3)).step_time
    only = choose_microbatches(32, layers, 4, candidates=[4])
    assert only.microbatches == 4 and only.stages[0].fwd == pytest.approx(2 * 1.0 / 4)
    with pytest.raises(ValueError, match=r"microbatch counts \[3, 5\] do not divide the batch size 32"):
        choose_microbatches(32, layers, 4, candidates=[3, 4, 5])
    sizes = []
    profile = lambda size: sizes.append(size) or scale_profile(uniform(8), size / 8)  # noqa: E731
    assert choose_microbatches(8, profile, 2, candidates=[2, 4]).microbatches == 4
    assert sizes == [4, 2]
    fixed_cost = choose_microbatches(8, lambda size: uniform(8), 2, candidates=[2, 4])
    assert fixed_cost.microbatches == 2  # per-microbatch time not shrinking: fewer microbatches win


def test_bytes_held_after_the_schedule_count_beside_the_state_not_the_activations():
    """A stage's memory is params + max(in_flight x activations, after): the data-parallel gradients'
    second copy (``after_bytes``) is made by the sync after the schedule, when the activations are gone."""
    from autopar.solver.inter_op import LayerProfile, partition_stages

    def layers(after):
        return [LayerProfile(f"l{i}", 1.0, 2.0, 10.0, 3.0, 1.0, after) for i in range(4)]

    base = partition_stages(layers(0.0), 2, 4, "1f1b")
    small = partition_stages(layers(1.0), 2, 4, "1f1b")            # under the activations: no change
    large = partition_stages(layers(100.0), 2, 4, "1f1b")          # over them: state + after
    assert [s.memory for s in small.stages] == [s.memory for s in base.stages]
    assert [s.memory for s in large.stages] == [20.0 + 200.0, 20.0 + 200.0]
    assert base.stages[0].memory == 20.0 + 2 * 6.0 and base.stages[1].memory == 20.0 + 6.0


def test_interleaved_counts_are_never_skipped_by_dominance():
    """The interleaved partition tries several v and checks each rank's peak, which no per-stage
    comparison bounds: no count is skipped without its DP."""
    from autopar.solver.pipeline_fit import holds_more

    assert not any(holds_more("interleaved_1f1b", 2, m, o) for m in (2, 4, 8) for o in (2, 4, 8, 16))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_count_holding_more_in_flight_fits_no_cut_where_a_lighter_one_fits_none(schedule):
    """What ``pipeline_search`` relies on to skip a microbatch count's DP: when m holds at least
    ``other``'s activations in flight on every stage (``holds_more``) and ``other`` fits no cut in
    the same room, m fits none either (profiles scaled to each count as ``UnitCosts.at`` does; the
    same gradient copy held after the schedule). Checked on random profiles between the least peaks;
    the least peak itself never falls."""
    from autopar.solver.inter_op import StageMemoryError, least_stage_memory
    from autopar.solver.pipeline_fit import holds_more

    rng = np.random.default_rng(7)
    batch, pp = 48, 2
    counts = [m for m in range(2, batch + 1) if batch % m == 0 and (schedule != "interleaved_1f1b" or m % pp == 0)]
    skipped = 0
    for _ in range(6):
        base = random_layers(rng, 6)
        at = {m: [LayerProfile(x.name, x.fwd / m, x.bwd / m, x.param_bytes, x.activation_bytes / m, x.out_bytes / m,
                               0.3 * x.param_bytes) for x in base] for m in counts}
        peaks = {m: least_stage_memory(at[m], pp, m, schedule) for m in counts}
        lo, hi = min(p * v for p, v in peaks.values()), max(p * v for p, v in peaks.values())
        for room in np.linspace(0.9 * lo, 1.1 * hi, 9) * (1 + 1e-9):    # off the exact peaks (float ties)
            fails = {}
            for m in counts:
                try:
                    partition_stages(at[m], pp, m, schedule, memory_budget=float(room))
                    fails[m] = False
                except StageMemoryError:
                    fails[m] = True
            for m in counts:
                for o in counts:
                    if o != m and holds_more(schedule, pp, m, o):
                        assert peaks[m][0] >= peaks[o][0] * (1 - 1e-12)
                        if fails[o]:
                            skipped += 1
                            assert fails[m], (m, o, room, peaks[m], peaks[o])
    assert skipped > 0


@pytest.mark.parametrize("seed", range(6))
def test_first_feasible_t_max_is_the_bisection_over_the_sum_dp(seed):
    """``_first_feasible`` (the bottleneck DP, one pass) returns the index the bisection over ``_best_sum``
    (one DP per probe) finds: the smallest stage-time cap under which some partition fits."""
    from autopar.solver.inter_op import _best_sum, _first_feasible, _stage_tables

    rng = np.random.default_rng(seed)
    n, p = int(rng.integers(3, 14)), int(rng.integers(1, 4))
    layers = [LayerProfile(f"l{i}", *rng.random(2), float(rng.random() * 10), float(rng.random() * 3),
                           float(rng.random())) for i in range(n)]
    budget = sum(x.param_bytes for x in layers) / p * float(rng.uniform(0.6, 2.0))
    tables = _stage_tables(layers, [p - s for s in range(p)], budget, (1e3, 1e-3), [], ())
    candidates = np.unique(tables.time[tables.allowed.any(axis=0)])
    lo, hi = 0, len(candidates)
    while lo < hi:
        mid = (lo + hi) // 2
        if _best_sum(tables, tables.allowed & (tables.time <= candidates[mid])[None])[1]:
            hi = mid
        else:
            lo = mid + 1
    assert _first_feasible(tables, candidates) == lo
