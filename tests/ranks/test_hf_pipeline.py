"""Tiny Hugging Face models train on pipelined plans exactly like one process.

SGD with momentum (not AdamW, which divides each gradient by its own size and so hides a
gradient of the wrong scale): losses, gathered first-step gradients and parameters after every
step at 1e-5 relative, tensor by tensor. BERT's attention key biases are the exception: their
true gradient is 0 (softmax ignores a shift shared by all keys), so both runs move them by float
noise (~1e-12) and only the whole-model parameter vector is compared for BERT.
"""
from __future__ import annotations

import functools
import math

import pytest

import autopar
import hf_zoo
from conftest import run_ranks
from hf_zoo import lm_loss
from oracle import assert_same_training, make_batch, parallel_run, reference_run

pytest.importorskip("transformers")

TENSOR_RTOL = {"llama": 1e-5, "gpt2": 1e-5, "bert": float("inf")}


def _job(rank, name, layers, shape, axes, schedule, microbatches):
    autopar.set_auto_parallel_context(schedule=schedule, microbatches=microbatches)
    x, y = make_batch("tokens", 8)
    mesh = autopar.Mesh(shape, axis_names=axes, device="a100-80gb")
    model_fn = functools.partial(getattr(hf_zoo, name), layers)
    return parallel_run(rank, model_fn, lm_loss, x, y, mesh, "auto", optim="sgd", lr=0.1)


SLOW = pytest.mark.slow
CASES = [("llama", 2, (2,), ("pp",), "1f1b", 2),
         pytest.param("llama", 4, (4,), ("pp",), "1f1b", 4, marks=SLOW),
         pytest.param("llama", 2, (2, 2), ("pp", "tp"), "1f1b", 2, marks=SLOW),
         pytest.param("llama", 2, (2, 2), ("pp", "dp"), "gpipe", 2, marks=SLOW),
         pytest.param("gpt2", 2, (2,), ("pp",), "1f1b", 2, marks=SLOW),
         pytest.param("bert", 2, (2,), ("pp",), "1f1b", 2, marks=SLOW)]


@pytest.mark.parametrize("name,layers,shape,axes,schedule,microbatches", CASES)
def test_hf_model_trains_pipelined_like_one_process(name, layers, shape, axes, schedule, microbatches):
    """Llama's rotary embedding runs under no_grad, which torch.export makes a higher-order op over
    a submodule of the graph: every pipelined plan failed with KeyError: 'submod_3' (issue 11)."""
    x, y = make_batch("tokens", 8)
    ref = reference_run(functools.partial(getattr(hf_zoo, name), layers), lm_loss, x, y, optim="sgd", lr=0.1)
    results = run_ranks(math.prod(shape), _job, name, layers, shape, axes, schedule, microbatches)
    for r, res in enumerate(results):
        assert res["degrees"]["pp"] == shape[0]
        assert_same_training(ref, res, tensor_rtol=TENSOR_RTOL[name], what=f"HF {name} {axes} rank {r}")
