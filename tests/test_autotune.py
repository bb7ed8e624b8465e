"""AUTO's measured choice (autotune_top_k): the ranks time the best predicted plans and keep the fastest."""
import functools

import pytest
import torch
import torch.nn.functional as F

import autopar
from conftest import run_ranks
from examples.models import MLP
from oracle import assert_same_training, make_batch, parallel_run, reference_run

MODEL = functools.partial(MLP, d_in=32, hidden=64, d_out=10, depth=2)


def _autotune_job(rank):
    x, y = make_batch("vector", 8, d_in=32)
    torch.manual_seed(0)
    before = {k: v.clone() for k, v in MODEL().state_dict().items()}
    autopar.set_auto_parallel_context(autotune_top_k=3, autotune_steps=2)
    try:
        out = parallel_run(rank, MODEL, F.cross_entropy, x, y, autopar.Mesh(4), "auto")
    finally:
        autopar.reset_auto_parallel_context()
    torch.manual_seed(0)
    out["untouched"] = all(torch.equal(before[k], v) for k, v in MODEL().state_dict().items())
    return out


def test_autotune_times_the_best_predicted_plans_and_trains_like_one_device():
    x, y = make_batch("vector", 8, d_in=32)
    ref = reference_run(MODEL, F.cross_entropy, x, y)
    results = run_ranks(4, _autotune_job)
    plans = [autopar.Plan.from_json(r["plan"]) for r in results]
    assert len({p.to_json() for p in plans}) == 1, "every rank must choose the same plan"
    trials = plans[0].options["autotune"]
    assert len(trials) == 3 and sum(t["chosen"] for t in trials) == 1
    chosen = next(t for t in trials if t["chosen"])
    assert chosen["measured"] == min(t["measured"] for t in trials if t["measured"] is not None)
    assert all(t["measured"] > 0 and t["predicted"] > 0 for t in trials)
    assert len({t["label"] for t in trials}) == 3
    assert "measured on the ranks" in plans[0].report()
    for r in results:
        assert_same_training(ref, r, what="autotuned AUTO")


def test_autotune_settings_are_checked():
    with pytest.raises(ValueError, match="autotune_top_k must be an int >= 0"):
        autopar.set_auto_parallel_context(autotune_top_k=-1)
    with pytest.raises(ValueError, match="autotune_steps must be an int >= 1"):
        autopar.set_auto_parallel_context(autotune_steps=0)
