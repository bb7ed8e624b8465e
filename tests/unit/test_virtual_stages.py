"""Virtual pipeline stages (interleaved 1F1B, v model stages per rank) as a planned choice: the v
the search tries, the per-rank memory of the interleaved order, the user's ``virtual_stages`` and
its errors, and a plan at v = 4 whose report shows it."""
from __future__ import annotations

import numpy as np
import pytest

import autopar
from autopar.schedules.schedule import build_schedule
from autopar.solver.inter_op import LayerProfile, StageMemoryError, brute_force_partition, partition_stages
from autopar.solver.interleaved_memory import rank_charges, rank_peaks
from autopar.solver.virtual_stages import best_over_virtual_stages, virtual_stage_choices
from examples.models import GPT, lm_loss
from oracle import make_batch

GIB = 2.0 ** 30


def uniform(n, param=1.0 * GIB, act=0.1 * GIB, after=0.0):
    return [LayerProfile(f"l{i}", 1.0, 2.0, param, act, 0.01 * GIB, after) for i in range(n)]


@pytest.mark.parametrize("p,m", [(2, 8), (4, 16)])
def test_rank_charges_are_megatrons_p_plus_p_minus_1_over_v(p, m):
    """Rank 0 holds p + (p - 1) / v microbatches of its layers at its peak (Narayanan et al., SC'21),
    under the sum of its stages' own peaks, and its charges sum to the replayed peak."""
    for v in (2, 4, 8):
        sched = build_schedule("interleaved_1f1b", p, m, v)
        charges = rank_charges("interleaved_1f1b", p, m, v)
        rank0 = sum(charges[s] for s in range(0, p * v, p))
        assert rank0 / v == pytest.approx(p + (p - 1) / v)
        stage_peaks = sched.in_flight()
        assert rank0 < sum(stage_peaks[s] for s in range(0, p * v, p))
        peaks = rank_peaks(sched, [0.0] * (p * v), [1.0] * (p * v), [0.0] * (p * v))
        assert peaks[0] == rank0


def test_rank_peaks_replay_the_order_with_each_stages_bytes():
    sched = build_schedule("interleaved_1f1b", 2, 4, 2)
    acts = [1.0, 10.0, 100.0, 1000.0]
    got = rank_peaks(sched, [5.0, 6.0, 7.0, 8.0], acts, [0.0] * 4)
    for r in range(2):
        held = best = 0.0
        for a in sched.actions[r]:
            held += acts[a.stage] * (1 if a.kind == "F" else -1)
            best = max(best, held)
        assert got[r] == pytest.approx(best + sum([5.0, 6.0, 7.0, 8.0][r::2]))


def test_bubble_at_v4_is_p_minus_1_over_v_m():
    """Equal stages, no p2p: idle time over busy time is (p - 1) / (v m)."""
    p, m, v = 2, 4, 4
    part = partition_stages(uniform(16), p, m, "interleaved_1f1b", virtual_stages=v)
    assert len(part.stages) == p * v and part.virtual_stages == v
    assert [s.rank for s in part.stages] == [0, 1] * v
    b = part.bubble_fraction
    assert b / (1 - b) == pytest.approx((p - 1) / (v * m))
    two = partition_stages(uniform(16), p, m, "interleaved_1f1b", virtual_stages=2)
    assert two.bubble_fraction > b


def test_a_rank_budget_is_shared_by_its_stages_not_split_evenly():
    """A heavy last layer (a language model's head): each stage within budget / v cannot hold it,
    the rank's stages together fit. The plan's rank peaks are within the budget and equal brute
    force over the same tables."""
    layers = uniform(8, param=1.0 * GIB, act=0.05 * GIB)
    layers[-1] = LayerProfile("head", 1.0, 2.0, 5.0 * GIB, 0.05 * GIB, 0.01 * GIB)
    budget = 9.0 * GIB                      # budget / 2 = 4.5 GiB < the head's 5 GiB
    part = partition_stages(layers, 2, 4, "interleaved_1f1b", memory_budget=budget, virtual_stages=2)
    assert max(part.rank_memory) <= budget
    assert part.stages[-1].memory > budget / 2
    brute = brute_force_partition(layers, 2, 4, "interleaved_1f1b", memory_budget=budget, virtual_stages=2)
    assert part.objective == pytest.approx(brute.objective)


@pytest.mark.parametrize("seed", range(8))
def test_interleaved_partitions_keep_every_rank_within_the_budget(seed):
    rng = np.random.default_rng(seed)
    layers = [LayerProfile(f"l{i}", rng.uniform(0.2, 2), rng.uniform(0.4, 4), rng.uniform(0.5, 3) * GIB,
                           rng.uniform(0.1, 1) * GIB, 0.01 * GIB, rng.uniform(0, 0.5) * GIB) for i in range(12)]
    budget = float(rng.uniform(10, 20)) * GIB
    for v in (2, 3, 4):
        try:
            part = partition_stages(layers, 2, 4, "interleaved_1f1b", memory_budget=budget, virtual_stages=v)
        except StageMemoryError:
            continue
        sched = build_schedule("interleaved_1f1b", 2, 4, v)
        spans = [s.layers for s in part.stages]
        exact = rank_peaks(sched, [sum(x.param_bytes for x in layers[a:b]) for a, b in spans],
                           [sum(x.activation_bytes for x in layers[a:b]) for a, b in spans],
                           [sum(x.after_bytes for x in layers[a:b]) for a, b in spans])
        assert part.rank_memory == pytest.approx(exact) and max(exact) <= budget


def test_v_choices_stop_at_the_units_and_a_small_bubble():
    assert virtual_stage_choices(4, 16, 34) == [2, 4, 8]        # Mixtral: 3 / (8 x 16) = 2.3 % still > 1 %
    assert virtual_stage_choices(4, 128, 34) == [2, 4]          # 3 / (4 x 128) < 1 %: no further doubling
    assert virtual_stage_choices(2, 4, 10) == [2, 4]            # 2 x 8 > 10 units
    assert virtual_stage_choices(4, 16, 34, fixed=3) == [3]


def test_the_search_takes_the_v_with_the_least_step():
    """Free hops: more virtual stages shrink the bubble; costly hops: v = 2."""
    from autopar.solver.pipeline_search import _partition
    from autopar.solver.inter_op import CutRules

    class Costs:
        profiles = uniform(16)
        sync = optimizer = [0.0] * 16

        def at(self, batch, m=None):
            return self.profiles

    free = _partition(Costs(), 1, 2, 4, "interleaved_1f1b", None, (1e30, 0.0), CutRules())[0]
    slow = _partition(Costs(), 1, 2, 4, "interleaved_1f1b", None, (1e30, 1.0), CutRules())[0]
    assert (free.virtual_stages, slow.virtual_stages) == (8, 2)
    fixed = _partition(Costs(), 1, 2, 4, "interleaved_1f1b", None, (1e30, 0.0), CutRules(virtual_stages=4))[0]
    assert fixed.virtual_stages == 4


def test_no_v_fits_raises_the_closest_memory_error():
    def cut(v):
        raise StageMemoryError(f"v={v}", state=float(10 - v), activations=0.0, share=v)
    with pytest.raises(StageMemoryError, match="v=4"):
        best_over_virtual_stages(cut, [2, 4])


X, Y = make_batch("tokens", 8)


def _plan(layers=8, **ctx):
    autopar.reset_auto_parallel_context()
    autopar.set_auto_parallel_context(**ctx)
    try:
        return autopar.plan(GPT(qkv_bias=False, layers=layers, hidden=32), autopar.Mesh((2,), axis_names=("pp",)),
                            example_inputs=(X,), loss_fn=lm_loss, example_target=Y, mode="auto")
    finally:
        autopar.reset_auto_parallel_context()


def test_plan_with_four_virtual_stages_and_its_report():
    plan = _plan(virtual_stages=4, microbatches=4)
    assert plan.schedule == "interleaved_1f1b" and plan.pipeline.virtual_stages == 4
    assert len(plan.stages) == 8 and [s.ranks for s in plan.stages] == [[0], [1]] * 4
    assert "(4 virtual stages per rank)" in plan.report()


def test_virtual_stages_errors_name_the_fault():
    with pytest.raises(ValueError, match="virtual_stages must be None .* or an int >= 2"):
        autopar.set_auto_parallel_context(virtual_stages=1)
    autopar.reset_auto_parallel_context()
    with pytest.raises(autopar.PlanError, match="virtual_stages=4 needs the 'interleaved_1f1b' schedule, but "
                                                "schedule='1f1b'"):
        _plan(layers=2, virtual_stages=4, schedule="1f1b", microbatches=4)
    with pytest.raises(autopar.PlanError, match=r"virtual_stages=4 on 2 pipeline ranks needs 8 model stages, but the "
                                                r"traced model has only \d+ layers"):
        _plan(layers=2, virtual_stages=4, microbatches=4)


@pytest.mark.slow
def test_unfixed_v_is_the_fastest_of_the_fixed_ones():
    """The planner's own v (schedule interleaved, v unset) is the least step of the fixed v it tries."""
    free = _plan(schedule="interleaved_1f1b", microbatches=4)
    fixed = {v: _plan(virtual_stages=v, microbatches=4) for v in virtual_stage_choices(2, 4, 8)}
    assert free.step_time == pytest.approx(min(p.step_time for p in fixed.values()))
    assert free.pipeline.virtual_stages == min(fixed, key=lambda v: fixed[v].step_time)


def test_no_interleaved_cut_fits_names_both_bounds():
    with pytest.raises(StageMemoryError, match=r"budget / 4 virtual stages = 1\.00 GiB \(and no cut found whose "
                                               r"ranks' peaks fit 4\.00 GiB together\)"):
        partition_stages(uniform(16), 2, 4, "interleaved_1f1b", memory_budget=4 * GIB, virtual_stages=4)
