"""Helpers shared by tests/ranks/test_zero_search.py and tests/unit/test_zero_search_plans.py."""
from __future__ import annotations

import functools

import autopar
from examples.models import GPT, lm_loss
from oracle import make_batch


MODEL = functools.partial(GPT, qkv_bias=False, layers=2, hidden=32)
BATCH = 16


def _probe():
    x, y = make_batch("tokens", BATCH)
    return autopar.plan(MODEL(), autopar.Mesh(2), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                        mode="data")


def _capped_mesh(frac: float) -> autopar.Mesh:
    """2 data-parallel devices whose cap holds ``frac`` of the training state beside all activations."""
    b = _probe().memory_breakdown
    cap = frac * b["params+grads+optimizer"] + b["activations"] + b["transient"]
    return autopar.Mesh(2, axis_names=("dp",), memory_gb=cap / 2**30)
