"""Planning raises Python's young-generation GC threshold and always restores it."""
import gc

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.core.gc_pause import PLANNING_THRESHOLD, fewer_collections


def test_threshold_raised_inside_and_restored_after_an_error():
    before = gc.get_threshold()
    with pytest.raises(ValueError, match="inside"):
        with fewer_collections():
            assert gc.get_threshold()[0] == max(before[0], PLANNING_THRESHOLD)
            assert gc.get_threshold()[1:] == before[1:]
            raise ValueError("inside")
    assert gc.get_threshold() == before


def test_plan_runs_under_the_raised_threshold_and_restores_it(monkeypatch):
    seen = []
    from autopar import api

    real = api._plan_traced

    def spy(*args, **kwargs):
        seen.append(gc.get_threshold()[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "_plan_traced", spy)
    before = gc.get_threshold()
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    autopar.plan(model, autopar.Mesh(2), example_inputs=(x,), loss_fn=lambda out, y: out.sum(),
                 example_target=torch.zeros(4), mode="data")
    assert seen == [max(before[0], PLANNING_THRESHOLD)]
    assert gc.get_threshold() == before
