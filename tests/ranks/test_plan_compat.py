"""Plan JSONs written before the typed plan fields (format 1, ``tests/data/plan_v0_*.json``) still
load into the typed fields, round-trip in the current format, and train like one device (HYBRID)."""
from __future__ import annotations

import functools
from pathlib import Path

import autopar
from autopar.plan.plan import FORMAT_VERSION, PipelineInfo
from conftest import run_ranks
from examples.models import GPT, lm_loss
from oracle import assert_same_training, make_batch, parallel_run, reference_run

DATA = Path(__file__).resolve().parents[1] / "data"
GPT_DATA = functools.partial(GPT, vocab=256, qkv_bias=False)
GPT_PIPE = functools.partial(GPT, qkv_bias=False, layers=2, hidden=32)


def _load(name: str) -> autopar.Plan:
    plan = autopar.Plan.load(DATA / name)
    again = autopar.Plan.from_json(plan.to_json())
    assert again == plan and '"format_version": %d' % FORMAT_VERSION in plan.to_json()
    return plan


def test_old_data_plan_loads_into_typed_fields():
    plan = _load("plan_v0_data_mesh2.json")
    assert plan.mode.value == "data" and plan.pipeline is None and plan.grad_compression is None
    assert plan.optimizer == "adamw" and plan.memory_budget and plan.axis_shares and plan.optimizer_time is not None
    assert not {"grad_compression", "optimizer", "memory_budget", "axis_shares", "pipeline"} & set(plan.options)


def test_old_pipeline_plan_loads_into_pipeline_info():
    plan = _load("plan_v0_pipeline_pp2tp2.json")
    assert plan.degrees["pp"] == 2 and isinstance(plan.pipeline, PipelineInfo)
    assert (plan.pipeline.microbatch_size, plan.pipeline.virtual_stages, plan.pipeline.sub_mesh) == (4, 1, [2])
    assert plan.pipeline.microbatch_fingerprint and 0 < plan.pipeline.bubble_fraction < 1
    assert plan.pipeline.pipeline_time > 0 and "pipeline" not in plan.options
    assert "bubble" in plan.report()


def test_old_compressed_plan_loads_grad_compression():
    plan = _load("plan_v0_bf16_mesh2.json")
    assert plan.grad_compression == "bf16" and "grad_compression" not in plan.options


def _hybrid_job(rank, name, model, vocab):
    x, y = make_batch("tokens", 8, **({"vocab": vocab} if vocab else {}))
    plan = autopar.Plan.load(DATA / name)
    return parallel_run(rank, model, lm_loss, x, y, plan.mesh, None, plan=plan)


def test_old_data_plan_trains_like_one_device():
    x, y = make_batch("tokens", 8, vocab=256)
    ref = reference_run(GPT_DATA, lm_loss, x, y)
    for r in run_ranks(2, _hybrid_job, "plan_v0_data_mesh2.json", GPT_DATA, 256):
        assert_same_training(ref, r, what="old data plan")


def test_old_pipeline_plan_trains_like_one_device():
    x, y = make_batch("tokens", 8)
    ref = reference_run(GPT_PIPE, lm_loss, x, y)
    for r in run_ranks(4, _hybrid_job, "plan_v0_pipeline_pp2tp2.json", GPT_PIPE, None):
        assert_same_training(ref, r, what="old pipeline plan")
