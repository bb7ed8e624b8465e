"""Helpers shared by tests/ranks/test_search_progress.py and tests/unit/test_search_progress_plans.py."""
from __future__ import annotations

import autopar
from examples import factories


def _job():
    return factories.gpt(hidden=64, layers=2, heads=4, seq=16, batch=8, vocab=128)


def _plan(**kw):
    model, x, loss, target = _job()
    return autopar.plan(model, autopar.Mesh(8, device="h100"), example_inputs=x, loss_fn=loss,
                        example_target=target, mode="auto", **kw)
