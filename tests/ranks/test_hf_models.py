"""Real Hugging Face models trace (torch.export non-strict) and plan; GPT-2 also trains on 2 ranks."""
from __future__ import annotations

import pytest
import torch

import autopar
from conftest import run_ranks
from hf_zoo import gpt2
from hf_zoo import lm_loss as _loss

transformers = pytest.importorskip("transformers")


def _gpt2():
    torch.manual_seed(0)
    return gpt2()


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 128, (4, 16), generator=g), torch.randint(0, 128, (4, 16), generator=g)


def test_hf_gpt2_plans_with_tied_embeddings():
    x, y = _data()
    plan = autopar.plan(_gpt2(), autopar.Mesh(2, axis_names=("tp",), device="a100-80gb"),
                        example_inputs=(x,), loss_fn=_loss, example_target=y, mode="auto")
    wte = plan.params["inner.transformer.wte.weight"]
    assert "inner.lm_head.weight" in wte.aliases


def _gpt2_job(rank):
    x, y = _data()
    pmodel = autopar.parallelize(_gpt2(), autopar.Mesh(2), example_inputs=(x,), loss_fn=_loss,
                                 example_target=y, mode="data")
    return float(pmodel.step(x, target=y))


def test_hf_gpt2_trains_under_data_parallel():
    x, y = _data()
    ref = _loss(_gpt2()(x), y).item()
    for got in run_ranks(2, _gpt2_job):
        assert abs(got - ref) <= 1e-5 * ref
