"""Partial recomputation (``graph/recompute_layers.py``, ``solver/partial_recompute.py``): which layers
``recompute_layers=k`` picks, the saved bytes it predicts (linear in k, "none" and "full" at the ends),
AUTO picking it under a cap between "full" and "none", and its bad inputs."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.cost_models.recompute import saved_storages
from autopar.frontend.trace import trace
from autopar.graph.recompute_layers import layers_choice, recompute_label, spread
from autopar.plan.plan import PlanError
from examples.models import GPT, lm_loss
from oracle import make_batch

VOCAB, SEQ, LAYERS = 64, 32, 4
DEVICE = "a100-80gb"


def _gpt(layers=LAYERS):
    torch.manual_seed(0)
    return GPT(vocab=VOCAB, hidden=32, heads=2, layers=layers, seq=SEQ, qkv_bias=False)


def _plan(**ctx):
    x, y = make_batch("tokens", 2, vocab=VOCAB, seq=SEQ)
    autopar.reset_auto_parallel_context()
    autopar.set_auto_parallel_context(**ctx)
    try:
        return autopar.plan(_gpt(), autopar.Mesh(1, device=DEVICE), example_inputs=(x,), loss_fn=lm_loss,
                            example_target=y, mode="auto")
    finally:
        autopar.reset_auto_parallel_context()


def test_spread_takes_the_first_layer_of_each_block():
    names = [f"blocks.{i}" for i in range(8)]
    assert spread(names, 0) == {}
    assert spread(names, 8) == {n: "full" for n in names}
    assert list(spread(names, 2)) == ["blocks.0", "blocks.4"]         # 2 stages of 4: the first of each
    assert list(spread(names, 4)) == ["blocks.0", "blocks.2", "blocks.4", "blocks.6"]
    assert all(len(spread(names, k)) == k for k in range(9))
    assert list(spread(names[:6], 4)) == ["blocks.0", "blocks.1", "blocks.3", "blocks.4"]
    with pytest.raises(ValueError, match="from 0 to the model's 8"):
        spread(names, 9)
    assert recompute_label(spread(names, 3)) == "full on 3 layers" and recompute_label("full") == "full"
    assert recompute_label({"blocks.0": "full"}) == "full on 1 layer"


def test_saved_bytes_fall_linearly_in_k():
    """The predicted saved activations under k recomputed layers: "none" at k = 0, "full" at k = L, the
    same step for each further layer (each layer saves the same and keeps only its input)."""
    x, y = make_batch("tokens", 2, vocab=VOCAB, seq=SEQ)
    gm = trace(_gpt(), (x,), lm_loss, y).gm

    def saved(recompute):
        return sum(nbytes for _, _, nbytes, _, _ in saved_storages(gm, recompute))

    by_k = [saved(layers_choice(gm, k)) for k in range(LAYERS + 1)]
    assert by_k[0] == saved("none") and by_k[-1] == saved("full")
    steps = [a - b for a, b in zip(by_k, by_k[1:])]
    assert steps[0] > 0 and all(s == steps[0] for s in steps), by_k


def layers_choice_of(k: int) -> dict:
    return spread([f"blocks.{i}" for i in range(LAYERS)], k)


def test_auto_under_a_cap_between_full_and_none_recomputes_some_layers():
    """With the cap between "full"'s memory and "selective"/"none"'s, AUTO keeps as many layers as fit:
    a {layer: "full"} mapping on fewer than all layers, faster than "full" and within the cap."""
    full, none = _plan(recompute="full"), _plan(recompute="none")
    low, high = max(full.memory_per_device), max(none.memory_per_device)   # (SDPA: selective saves little)
    cap = low + 0.4 * (high - low)
    plan = _plan(memory_budget_gb=cap / 2**30)
    chosen = plan.memory_options.recompute
    assert isinstance(chosen, dict) and 0 < len(chosen) < LAYERS, chosen
    assert max(plan.memory_per_device) <= cap and plan.step_time < full.step_time
    assert f"recompute full on {len(chosen)} layer" in plan.memory_options.summary()
    assert chosen == layers_choice_of(len(chosen))     # what recompute_layers=len(chosen) would fix


def test_recompute_layers_bad_inputs():
    with pytest.raises(PlanError, match=r"recompute_layers=9 is more than the model's 4 repeated layers"):
        _plan(recompute_layers=9)
    with pytest.raises(PlanError, match=r"recompute_layers=2 recomputes whole layers \('full'\) but "
                                        r"recompute='selective'"):
        _plan(recompute_layers=2, recompute="selective")
    with pytest.raises(ValueError, match="recompute_layers must be None or an int >= 0"):
        autopar.set_auto_parallel_context(recompute_layers=-1)
    autopar.reset_auto_parallel_context()
    x = torch.randn(4, 8)
    autopar.set_auto_parallel_context(recompute_layers=1)
    try:
        with pytest.raises(PlanError, match="recompute_layers=1: this model has no repeated layers"):
            autopar.plan(torch.nn.Linear(8, 8), autopar.Mesh(1, device=DEVICE), example_inputs=(x,),
                         loss_fn=lambda out, t: out.square().mean(), example_target=x, mode="auto")
    finally:
        autopar.reset_auto_parallel_context()
