"""Helpers shared by tests/ranks/test_accumulation_plan.py and tests/unit/test_accumulation_choice.py."""
from __future__ import annotations

import functools

import autopar
from examples.models import GPT, lm_loss
from oracle import make_batch


MODEL = functools.partial(GPT, qkv_bias=False, layers=2, hidden=32)
BATCH = 16


def _capped_mesh() -> autopar.Mesh:
    """A 2-device data-parallel mesh whose cap holds the training state but only 30 % of the activations."""
    x, y = make_batch("tokens", BATCH)
    probe = autopar.plan(MODEL(), autopar.Mesh(2), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                         mode="data")
    b = probe.memory_breakdown
    return autopar.Mesh(2, axis_names=("dp",), memory_gb=(b["params+grads+optimizer"] + 0.3 * b["activations"]) / 2**30)
