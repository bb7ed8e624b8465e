"""Activation recomputation (``plan.memory_options.recompute``): the cost functions
(``cost_models/recompute.py``) on GPTs, the lowering (``passes/recompute.py``) through the oracle
on DATA, TP and a pipeline, with dropout replayed exactly, the saved bytes of a real step against
the prediction, and a mapping that names a layer the model lacks."""
from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import autopar
from conftest import run_ranks
from examples.models import lm_loss
from oracle import assert_same_training, parallel_run, reference_run
from recompute_jobs import DEVICE, _tokens, _with, gpt


def _megatron():
    autopar.shard({"blocks.*.fc1": ColwiseParallel()} | {f"blocks.*.{n}": RowwiseParallel() for n in ("proj", "fc2")},
                  axis="tp")
    autopar.shard("blocks.*.qkv", weight={"tp": autopar.Shard(0, 3)})


def _plan(kind: str, model_fn):
    x, y = _tokens()
    autopar.reset_auto_parallel_context()
    autopar.clear_annotations()
    if kind == "data":
        mesh, mode = autopar.Mesh(2, device=DEVICE), "data"
    elif kind == "tp":
        mesh, mode = autopar.Mesh(2, axis_names=("tp",), device=DEVICE), "semi_auto"
        _megatron()
    else:
        mesh, mode = autopar.Mesh(2, axis_names=("pp",), device=DEVICE), "auto"
        autopar.set_auto_parallel_context(schedule="1f1b", microbatches=2)
    try:
        torch.manual_seed(0)
        plan = autopar.plan(model_fn(), mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, mode=mode)
    finally:
        autopar.reset_auto_parallel_context()
        autopar.clear_annotations()
    return plan, mesh


def _oracle_job(rank, plan_json, mesh, runs):
    """``runs``: (dropout, recompute choice) pairs, each trained from the same plan."""
    x, y = _tokens()
    plan = autopar.Plan.from_json(plan_json)
    out = {}
    for dropout, choice in runs:
        model_fn = functools.partial(gpt, dropout=dropout)
        out[(dropout, str(choice))] = parallel_run(rank, model_fn, lm_loss, x, y, mesh, None, plan=_with(plan, choice),
                                                   steps=2)
    torch.manual_seed(0)         # every rank builds (parallelize runs collectives); rank 0's code is checked
    pm = autopar.parallelize(gpt(), mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                             plan=_with(plan, "full"))
    out["code"] = pm.code
    with autopar.count_collectives() as counter:
        pm.step(x, target=y)
    out["collectives"] = [(kind, axis, phase) for kind, _, axis, phase in counter.calls]
    if hasattr(pm.program, "gm"):
        out["region_code"] = pm.program.gm.get_submodule("recompute_blocks_0").body.code
    torch.manual_seed(0)
    pm = autopar.parallelize(gpt(), mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                             plan=_with(plan, KEPT))
    out["kept_code"] = pm.code
    if hasattr(pm.program, "gm"):
        out["kept_regions"] = [pm.program.gm.get_submodule(f"recompute_blocks_0_part_{i}").body.code for i in (0, 1)]
    return out


MIXED = {"blocks.0": "full", "blocks.1": "selective"}
KEPT = {"blocks.0": "except_attention", "blocks.1": "full"}     # the attention core kept in blocks.0


@pytest.mark.parametrize("kind", ["data", "tp", "pipeline"])
def test_recompute_trains_like_one_device(kind):
    """dropout 0: "full" and per-layer mappings (full and selective; except_attention and full) train like
    the single-device run. dropout 0.1: the mappings (dropout inside a full or except_attention region)
    train exactly like the same plan without recomputation: the masks are replayed in backward."""
    x, y = _tokens()
    plan, mesh = _plan(kind, gpt)
    if kind == "tp":
        assert plan.degrees["tp"] == 2 and any(c.axes == ["tp"] for c in plan.collective_list)
    if kind == "pipeline":
        assert plan.degrees["pp"] == 2
    ref = reference_run(gpt, lm_loss, x, y, steps=2)
    runs = [(0.0, "full"), (0.0, MIXED), (0.0, KEPT), (0.1, "none"), (0.1, MIXED), (0.1, KEPT)]
    results = run_ranks(2, _oracle_job, plan.to_json(), mesh, runs)
    for r in results:
        for choice in ("full", MIXED, KEPT):
            assert_same_training(ref, r[(0.0, str(choice))], what=f"{kind} recompute={choice}")
        for choice in (MIXED, KEPT):
            assert_same_training(r[(0.1, "none")], r[(0.1, str(choice))], rtol=1e-6, what=f"{kind} dropout {choice}")
        assert r[(0.1, "none")]["losses"] != r[(0.0, "full")]["losses"]    # dropout did act
    assert "self.recompute_blocks_0(" in results[0]["code"]
    assert "self.recompute_blocks_0_part_0(" in results[0]["kept_code"]
    assert "self.recompute_blocks_0_part_1(" in results[0]["kept_code"]
    for body in results[0].get("kept_regions", []):      # the attention core runs outside both parts
        assert "scaled_dot_product_attention.default(" not in body and "linear" in body
    if kind == "tp":    # the layer's all-reduces run inside the checkpointed region, again in backward
        assert "all_reduce" in results[0]["region_code"]
        calls = results[0]["collectives"]
        again = [c for c in calls if c[2] == "recompute"]
        assert 0 < len(again) <= sum(c[2] == "fwd" for c in calls) and {c[1] for c in again} == {"tp"}
        assert results[1]["collectives"] == calls       # the same collectives in the same order on every rank
