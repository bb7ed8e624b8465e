"""AUTO tries ZeRO-1 on its best pipelined plan even where ZeRO-0 fits freely (solver/zero_upgrade.py):
in a pipeline ZeRO-1 adds no collective and shards the optimizer step, so a forced ZeRO-1 layout
(Megatron's published pipelines use its distributed optimizer) can beat the ZeRO-0 pick; the search
must be at least as fast as that forced plan."""
from __future__ import annotations

import pytest
import torch

import autopar
from examples.models import GPT, lm_loss

MESH = dict(shape=(2, 2), axis_names=("pp", "dp"), device="h100")


def _plan(mesh, mode="semi_auto", **context):
    autopar.reset_auto_parallel_context()
    try:
        autopar.set_auto_parallel_context(microbatches=4, **context)
        with torch.device("meta"):
            model = GPT(layers=4, hidden=1024, heads=16, vocab=32000, seq=128)
        x = torch.zeros(32, 128, dtype=torch.long)
        return autopar.plan(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=x, mode=mode,
                            mixed_precision="bf16")
    finally:
        autopar.reset_auto_parallel_context()


@pytest.fixture(scope="module")
def plans():
    mesh = autopar.Mesh(MESH["shape"], axis_names=MESH["axis_names"], device=MESH["device"])
    return _plan(mesh), _plan(mesh, zero=0), _plan(mesh, zero=1)


def test_the_search_is_at_least_as_fast_as_the_zero1_pipeline_forced_on_its_mesh(plans):
    free, zero0, forced1 = plans
    assert forced1.step_time < zero0.step_time, "the job no longer shows ZeRO-1's faster optimizer step"
    assert free.step_time <= forced1.step_time * (1 + 1e-9), (free.step_time, forced1.step_time)
    assert free.memory_options.zero == 1 and free.pipeline is not None
    assert any(a.fits and "ZeRO" not in a.memory_options and abs(a.step_time - zero0.step_time) <= 1e-9 * zero0.step_time
               for a in free.alternatives), "the ZeRO-0 pipeline is not listed beside the chosen one"


def test_a_zero_stage_the_user_sets_is_kept(plans):
    _, zero0, forced1 = plans
    assert (zero0.memory_options.zero, forced1.memory_options.zero) == (0, 1)


def test_without_a_pipeline_zero_stays_a_memory_lever():
    """A data-parallel job that fits keeps ZeRO-0 (the ladder's rule; no probe without a pipeline)."""
    mesh = autopar.Mesh((4,), axis_names=("dp",), device="h100")
    autopar.reset_auto_parallel_context()
    with torch.device("meta"):
        model = GPT(layers=2, hidden=256, heads=4, vocab=1024, seq=64)
    x = torch.zeros(8, 64, dtype=torch.long)
    plan = autopar.plan(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=x, mode="semi_auto")
    assert plan.memory_options.zero == 0 and plan.pipeline is None
