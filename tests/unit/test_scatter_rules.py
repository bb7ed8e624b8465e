"""``new_empty`` + ``slice_scatter`` (HF DeepSeek-V3's latent attention builds its keys so) split
like their neighbours (``sharding/rules/scatter.py``): under data parallelism each rank holds its
rows of the keys, not the whole batch's; the per-rank program allocates its local size."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.passes.localize_shapes import localize_shapes
from autopar.sharding.candidates import build_candidates
from autopar.sharding.placements import Shard, Spec

pytest.importorskip("transformers")


def _tiny_deepseek():
    from examples.hf_moe_zoo import moe_model

    return moe_model("deepseek_v3")


def _targets(gm, target):
    return [n for n in gm.graph.nodes if n.target == target]


def test_new_empty_and_slice_scatter_split_the_batch_and_localize():
    zm = _tiny_deepseek()
    x = zm.inputs[0][0]
    plan = autopar.plan(zm.module, autopar.Mesh(4), example_inputs=(x,), loss_fn=zm.loss_fn, example_target=zm.target,
                        mode="data")
    from autopar.frontend.trace import trace

    gm = trace(zm.module, (x,), zm.loss_fn, zm.target).gm
    empties = _targets(gm, torch.ops.aten.new_empty.default)
    scatters = _targets(gm, torch.ops.aten.slice_scatter.default)
    assert empties and scatters
    for n in empties + scatters:
        assert plan.nodes[n.name].output == Spec((Shard(0),)), (n.name, plan.nodes[n.name].output)
    batch = x.shape[0]
    localize_shapes(gm, plan, (4,))
    for n in empties:
        assert n.args[1][0] == batch // 4 and list(n.args[1][1:]) == list(n.meta["val"].shape[1:]), n.args


def test_rules_offer_every_dim_but_the_scattered_one():
    zm = _tiny_deepseek()
    from autopar.frontend.trace import trace

    gm = trace(zm.module, zm.inputs[0], zm.loss_fn, zm.target).gm
    cands = build_candidates(gm, (2,))
    scatter = _targets(gm, torch.ops.aten.slice_scatter.default)[0]
    dim = scatter.args[2] % scatter.meta["val"].dim()
    outs = {st.output[0] for st in cands.strategies[scatter.name]}
    want = {Shard(d) for d in range(scatter.meta["val"].dim()) if d != dim}
    assert want <= outs and Shard(dim) not in outs
