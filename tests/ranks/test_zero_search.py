"""ZeRO as a plan choice: the intra-op problem costs each stage (state divided over the axes a
parameter is replicated on, optimizer step divided, weight all-gathers added), AUTO/SEMI_AUTO try
stages 0-3 while nothing fits and keep the fastest, the user can fix a stage
(``set_auto_parallel_context(zero=...)``), and ``plan.collectives`` lists what runtime/zero.py runs."""
from __future__ import annotations

from collections import Counter

import autopar
from conftest import run_ranks
from examples.models import lm_loss
from oracle import assert_same_training, distance, make_batch, parallel_run, reference_run
from zero_search_jobs import BATCH, MODEL, _capped_mesh


def _job(rank):
    x, y = make_batch("tokens", BATCH)
    out = parallel_run(rank, MODEL, lm_loss, x, y, _capped_mesh(0.78), "auto", steps=2)
    plan = autopar.Plan.from_json(out["plan"])
    pm = autopar.parallelize(MODEL(), plan.mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, plan=plan)
    pm.step(x, target=y)
    with autopar.count_collectives() as counter:
        pm.step(x, target=y)
        pm._zero.all_gather()            # what the optimizer-step hook runs after opt.step()
    out["ran"] = Counter((kind, phase) for kind, _, _, phase in counter.calls)
    out["planned"] = Counter((c.kind, c.phase) for c in plan.collectives(rank))
    return out


def test_auto_picked_zero_trains_like_one_device_and_runs_its_list():
    x, y = make_batch("tokens", BATCH)
    ref = reference_run(MODEL, lm_loss, x, y, steps=2)
    for r in run_ranks(2, _job):
        plan = autopar.Plan.from_json(r["plan"])
        assert plan.memory_options.zero in (1, 2), plan.memory_options
        assert_same_training(ref, r, what=f"auto {plan.memory_options.summary()}")
        planned, ran = r["planned"], r["ran"]
        for key in (("reduce_scatter", "bwd"), ("all_gather", "step")):
            assert planned[key] > 0 and ran[key] > 0, (key, planned, ran)   # the runtime buckets: fewer calls
        assert planned[("all_reduce", "bwd")] == 0 and ran[("all_reduce", "bwd")] == 0


def _mixed_job(rank, zero):
    x, y = make_batch("tokens", BATCH)
    autopar.set_auto_parallel_context(zero=zero, mixed_precision="bf16")
    return parallel_run(rank, MODEL, lm_loss, x, y, autopar.Mesh(2), "data", steps=2)


def test_zero_under_bf16_mixed_precision_trains_like_bf16_without_it():
    """ZeRO-1 moves where the fp32 masters and moments live, not the arithmetic: on 2 ranks (a
    two-term sum is exact in any order) it trains exactly like the same bf16 plan without ZeRO.
    ZeRO-3 gathers bf16 weights per layer, so a tied weight's two uses meet in another order: it
    must be no further from the fp32 one-device run than 2x the bf16 plan without ZeRO (the
    yardstick of tests/ranks/test_mixed_precision.py)."""
    x, y = make_batch("tokens", BATCH)
    ref = reference_run(MODEL, lm_loss, x, y, steps=2)
    plain = run_ranks(2, _mixed_job, 0)
    for zero in (1, 3):
        for r0, r in zip(plain, run_ranks(2, _mixed_job, zero)):
            assert autopar.Plan.from_json(r["plan"]).memory_options.zero == zero
            if zero == 1:
                assert_same_training(r0, r, 1e-6, f"bf16 ZeRO-{zero} vs bf16")
            else:
                assert distance(r, ref) <= 2 * distance(r0, ref), (distance(r, ref), distance(r0, ref))
