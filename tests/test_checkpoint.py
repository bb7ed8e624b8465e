"""Checkpoints reshard: saved under one plan, loaded under another, training resumes identically."""
from __future__ import annotations

import functools

import torch

import autopar
from conftest import run_ranks
from examples.models import GPT, lm_loss
from oracle import make_batch, rel_error

MODEL = functools.partial(GPT, qkv_bias=False)


def _save_tp(rank, path):
    x, y = make_batch("tokens", 8)
    torch.manual_seed(0)
    mesh = autopar.Mesh(2, axis_names=("tp",), device="a100-80gb")
    autopar.shard("blocks.*.fc1", weight={"tp": autopar.Shard(0)})
    pmodel = autopar.parallelize(MODEL(), mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                                 mode="semi_auto")
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    pmodel.step(x, target=y)
    opt.step()
    pmodel.save(path, optimizer=opt)
    return pmodel.full_state_dict()


def _load_data(rank, path):
    x, y = make_batch("tokens", 8)
    torch.manual_seed(1)  # different initial weights: everything must come from the checkpoint
    pmodel = autopar.parallelize(MODEL(), autopar.Mesh(2), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                                 mode="data")
    pmodel.load(path)
    return pmodel.full_state_dict()


def test_save_under_tensor_parallel_load_under_data_parallel(tmp_path):
    saved = run_ranks(2, _save_tp, str(tmp_path / "ckpt"))[0]
    loaded = run_ranks(2, _load_data, str(tmp_path / "ckpt"))[0]
    assert saved.keys() == loaded.keys()
    for k, v in saved.items():
        assert torch.equal(v, loaded[k]) or rel_error(loaded[k], v) == 0.0, k
    assert (tmp_path / "ckpt" / "model.pt").exists() and (tmp_path / "ckpt" / "optim.rank1.pt").exists()
