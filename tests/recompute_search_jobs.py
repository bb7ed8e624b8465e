"""Helpers shared by tests/ranks/test_recompute_search.py and tests/unit/test_recompute_search_plans.py."""
from __future__ import annotations

import functools

import torch

import autopar
from examples.models import GPT, lm_loss
from oracle import make_batch


MODEL = functools.partial(GPT, qkv_bias=False, layers=2, hidden=32)
BATCH = 16


@functools.lru_cache(maxsize=None)
def _capped_mesh(frac: float) -> autopar.Mesh:
    """A 2-device data-parallel mesh whose cap holds the training state and ``frac`` of the activations
    (the transient workspace, a recomputed layer's re-made activations included, must fit in that too)."""
    x, y = make_batch("tokens", BATCH)
    probe = autopar.plan(MODEL(), autopar.Mesh(2), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                         mode="data")
    b = probe.memory_breakdown
    cap = b["params+grads+optimizer"] + frac * b["activations"]
    return autopar.Mesh(2, axis_names=("dp",), memory_gb=cap / 2**30)


PIPE_MODEL = functools.partial(GPT, vocab=128, hidden=64, heads=4, layers=4, seq=32, qkv_bias=False)


def _pipe_plan(mesh, rc=None, microbatches=None, schedule=None):
    x = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))
    if rc:
        autopar.set_auto_parallel_context(recompute=rc, microbatches=microbatches, schedule=schedule)
    try:
        return autopar.plan(PIPE_MODEL(), mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=x, mode="auto")
    finally:
        autopar.reset_auto_parallel_context()


@functools.lru_cache(maxsize=None)
def _pipe_cap_gb() -> float:
    """The cap of ``_pipe_capped_mesh``: 2 plans, made once per process (the ranks are given it)."""
    peak = {rc: max(_pipe_plan(autopar.Mesh((2,), axis_names=("pp",)), rc, 8, "1f1b").memory_per_device)
            for rc in ("none", "full")}
    assert peak["full"] < peak["none"]
    cap = peak["full"] + 0.75 * (peak["none"] - peak["full"])   # room for AUTO's own choice of m and schedule
    return cap / 2**30


def _pipe_capped_mesh(cap_gb: float | None = None) -> autopar.Mesh:
    """A 2-stage pipeline mesh whose cap lies between the least peaks with and without recomputation:
    those of 8 microbatches under 1F1B (4 microbatches hold larger ones in flight, and an interleaved
    rank posts receive buffers for two stages: both peak higher, with and without recomputation)."""
    return autopar.Mesh((2,), axis_names=("pp",), memory_gb=cap_gb if cap_gb is not None else _pipe_cap_gb())
