"""Mesh(1) runs without any process group: the same program, every collective a no-op."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import autopar
from examples.models import GPT, lm_loss
from oracle import assert_same_training, make_batch, parallel_run, reference_run


def test_mesh_of_one_trains_like_the_model_without_a_process_group():
    x, y = make_batch("tokens", 4)
    ref = reference_run(lambda: GPT(qkv_bias=False), lm_loss, x, y, steps=2)
    got = parallel_run(0, lambda: GPT(qkv_bias=False), lm_loss, x, y, autopar.Mesh(1), "auto", steps=2)
    assert_same_training(ref, got, what="Mesh(1)")
    torch.manual_seed(0)
    pmodel = autopar.parallelize(GPT(qkv_bias=False), autopar.Mesh(1), example_inputs=(x,), loss_fn=lm_loss,
                                 example_target=y, mode="auto")
    out = pmodel(x)
    assert out.shape == (4, 16, 128)
    assert abs(F.cross_entropy(out.flatten(0, 1), y.flatten()).item() - got["losses"][0]) <= 1e-5 * got["losses"][0]
