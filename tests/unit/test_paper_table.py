"""bench/paper_table.py's forced-configuration path on a shrunken Table-1 row: the published
(t, p, d) and memory options are what the plan uses, the reported TFLOP/s is the paper's FLOP
count over the predicted step, and the process-wide context and annotations are left clean."""
from __future__ import annotations

import dataclasses
import math

import pytest

import autopar
from bench.paper_table import breakdown, forced_mismatches, forced_result, plan_forced, tflops_per_gpu
from examples.megatron_table1 import TABLE1, paper_flops_per_step

# the 39.1B row's shape (t=8, p=2 -> here t=2, p=2, d=2), small enough to plan in seconds
SMALL = dataclasses.replace(TABLE1[4], billions=0.05, heads=4, hidden=256, layers=4, t=2, p=2, gpus=8, batch=16)


def test_forced_plan_is_the_published_configuration():
    before = autopar.get_auto_parallel_context()
    plan, wall = plan_forced(SMALL)
    assert plan.degrees == {"dp": 2, "tp": 2, "pp": 2, "ep": 1, "cp": 1}
    assert plan.mesh.axis_names == ("pp", "dp", "tp")
    mo = plan.memory_options
    assert (mo.mixed_precision, mo.recompute, mo.zero) == ("bf16", "full", 0)
    assert plan.microbatches >= 2 and plan.schedule in ("gpipe", "1f1b", "interleaved_1f1b")
    assert forced_mismatches(SMALL, plan) == []
    # every parameter whole on the dp axis (pure data parallelism, as the paper ran it)
    dp = plan.mesh.axis_index("dp")
    assert all(isinstance(d.spec[dp], autopar.Replicate) for d in plan.params.values())
    assert autopar.get_auto_parallel_context() == before
    from autopar.solver.annotations import ANNOTATIONS
    assert ANNOTATIONS.empty()
    tf = tflops_per_gpu(SMALL, plan.step_time)
    assert tf == pytest.approx(paper_flops_per_step(SMALL) / plan.step_time / 8 / 1e12)
    terms = breakdown(SMALL, plan)
    assert terms["tp"] > 0 and terms["pp"] > 0 and terms["bubble"] > 0
    assert math.isclose(sum(v for k, v in terms.items() if k != "flop_peak"), plan.step_time, rel_tol=1e-9)


def test_mismatch_is_reported():
    plan, _ = plan_forced(SMALL)
    other = dataclasses.replace(SMALL, t=1, gpus=4)
    assert any(m.startswith("degrees") for m in forced_mismatches(other, plan))


def test_forced_result_row():
    f = forced_result(SMALL)
    assert "error" not in f, f.get("error")
    assert f["mismatch"] == [] and f["tflops"] > 0 and f["ratio"] == pytest.approx(f["tflops"] / SMALL.tflops)
    # the planner's own FLOP count has no recomputation: about 3/4 of the paper's
    assert 0.6 < f["flops_ratio"] < 0.9
