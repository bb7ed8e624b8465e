"""``parallelize`` keeps no reference to the weights of the model it was given: the ParallelModule trains
its own tensors, so the user's ``del model`` frees the whole model (on a GPU, one full fp32 copy of the
parameters per rank). ``pmodel.eval()`` still traces the model again in the other mode, from a copy that
holds no storage (``modules/mode_switch.storage_free``), and runs as the model does in eval mode."""
from __future__ import annotations

import copy
import gc
import weakref

import torch

import autopar
from autopar.modules.mode_switch import storage_free
from examples.models import GPT, lm_loss


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 128, (4, 16), generator=g), torch.randint(0, 128, (4, 16), generator=g)


def test_model_freed_after_parallelize_and_eval_still_traces():
    torch.manual_seed(0)
    model = GPT(vocab=128, hidden=32, heads=4, layers=2, seq=16, dropout=0.3)
    reference = copy.deepcopy(model).eval()
    weights = [weakref.ref(p) for p in model.parameters()]
    x, y = _data()
    pmodel = autopar.parallelize(model, autopar.Mesh(1), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                                 mode="stand_alone")
    del model
    gc.collect()
    alive = [w for w in weights if w() is not None]
    assert not alive, f"{len(alive)} of {len(weights)} parameters of the given model are still referenced"
    pmodel.eval()
    with torch.no_grad():
        got, want = pmodel(x), reference(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    pmodel.train()
    assert pmodel.training


def test_storage_free_copy_shares_nothing_and_keeps_ties():
    model = GPT(vocab=64, hidden=16, heads=2, layers=1, seq=8)
    model.lm_head.weight = model.wte.weight                     # tied
    skeleton = storage_free(model)
    assert skeleton.lm_head.weight is skeleton.wte.weight
    assert all(p.is_meta for p in skeleton.parameters()) and all(b.is_meta for b in skeleton.buffers())
    assert [n for n, _ in skeleton.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert [p.shape for p in skeleton.parameters()] == [p.shape for p in model.parameters()]
    assert not any(p.is_meta for p in model.parameters())
