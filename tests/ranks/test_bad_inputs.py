"""Bad arguments (meshes, inputs at step, losses, stage tags, leftover annotations, plan files)
get one clear error naming the argument at fault, what it got and what to do."""
from __future__ import annotations

import torch.nn.functional as F

import autopar
from conftest import run_ranks
from examples.models import MLP
from oracle import make_batch


def _wrong_world(rank):
    x, y = make_batch("vector", 8)
    try:
        autopar.parallelize(MLP(), autopar.Mesh(4), example_inputs=(x,), loss_fn=F.cross_entropy, example_target=y,
                            mode="data")
    except ValueError as err:
        return str(err)
    return "no error"


def test_mesh_size_must_match_the_world_size():
    msg = run_ranks(2, _wrong_world)[0]
    assert "has 4 devices but torch.distributed has 2 ranks" in msg and "autopar.Mesh(2)" in msg, msg
