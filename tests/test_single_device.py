"""Mesh(1) runs without any process group: the same program, every collective a no-op."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import autopar
from examples.models import GPT, lm_loss
from oracle import make_batch, reference_run


def test_mesh_of_one_trains_like_the_model_without_a_process_group():
    x, y = make_batch("tokens", 4)
    ref = reference_run(lambda: GPT(qkv_bias=False), lm_loss, x, y, steps=2, optim="adamw")
    torch.manual_seed(0)
    pmodel = autopar.parallelize(GPT(qkv_bias=False), autopar.Mesh(1), example_inputs=(x,), loss_fn=lm_loss,
                                 example_target=y, mode="auto")
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    losses = []
    for _ in range(2):
        losses.append(float(pmodel.step(x, target=y)))
        opt.step()
        opt.zero_grad()
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(losses, ref["losses"]))
    out = pmodel(x)
    assert out.shape == (4, 16, 128)
    assert F.cross_entropy(out.flatten(0, 1), y.flatten()).item() < losses[0]
