"""The standard loop's silent failures made loud (issue 32, parts 2 and 5): an optimizer built on the
original model's parameters, ``loss.backward()`` on the loss ``pmodel.step`` returns, a model with
nothing to train; and ``pmodel.sync_to(model)``, which copies the trained state back."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from conftest import run_ranks
from examples.models import GPT, MLP
from hf_zoo import lm_loss
from oracle import make_batch


def _one_device(model=None):
    torch.manual_seed(0)
    model = model if model is not None else MLP()
    x, y = make_batch("vector", 8)
    pmodel = autopar.parallelize(model, autopar.Mesh(1), example_inputs=(x,), loss_fn=F.cross_entropy,
                                 example_target=y)
    return model, pmodel, x, y


# ---- part 2: an optimizer over the original model --------------------------------------------

def test_optimizer_on_the_original_model_is_refused_at_its_step():
    model, pmodel, x, y = _one_device()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.step()                                  # nothing pending: a no-op as in torch, no error
    pmodel.step(x, target=y)
    with pytest.raises(RuntimeError, match=r"this SGD holds 6 parameter\(s\) of the original model, none of the "
                                           r"parallelized module's.*Build the optimizer on pmodel.parameters\(\).*"
                                           r"pmodel.sync_to\(model\)"):
        opt.step()


def test_the_right_optimizer_and_a_one_device_run_beside_pmodel_are_left_alone():
    model, pmodel, x, y = _one_device()
    twin = MLP()
    twin.load_state_dict(model.state_dict())
    good = torch.optim.SGD(pmodel.parameters(), lr=0.1)
    pmodel.step(x, target=y)
    good.step()
    ref = torch.optim.SGD(model.parameters(), lr=0.1)     # the original trained on its own, one device
    pmodel.step(x, target=y)
    F.cross_entropy(model(x), y).backward()
    ref.step()                                  # its parameters have gradients: it trains, no error
    other = torch.optim.SGD(twin.parameters(), lr=0.1)    # another model's optimizer: not autopar's business
    other.step()
    good.step()


# ---- part 5: step's loss, models with nothing to train ---------------------------------------

def test_backward_on_the_loss_step_returns_says_step_already_ran_it():
    _, pmodel, x, y = _one_device()
    loss = pmodel.step(x, target=y)
    assert isinstance(loss, torch.Tensor) and not loss.requires_grad and repr(loss).startswith("tensor(")
    assert type(loss * 2) is torch.Tensor and float(loss) > 0
    with pytest.raises(RuntimeError, match=r"the loss pmodel.step\(...\) returns is detached: pmodel.step already ran "
                                           r"the backward pass .*Do not call loss.backward\(\); call opt.step\(\)"):
        loss.backward()


class _NoParams(nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2


def test_step_on_a_model_with_no_parameters_says_so():
    x, y = make_batch("vector", 8, d_in=10)
    pmodel = autopar.parallelize(_NoParams(), autopar.Mesh(1), example_inputs=(x,), loss_fn=F.cross_entropy,
                                 example_target=y)
    assert pmodel(x).shape == (8, 10)               # a forward pass still works
    with pytest.raises(ValueError, match=r"pmodel.step\(\) trains, but the model has no parameters: its loss has no "
                                         r"gradient to take. Use pmodel\(x\) for a forward pass"):
        pmodel.step(x, target=y)


def test_step_on_a_fully_frozen_model_says_so():
    model = MLP()
    model.requires_grad_(False)
    _, pmodel, x, y = _one_device(model)
    with pytest.raises(ValueError, match=r"the model has no trainable parameter \(its 6 parameter\(s\) are frozen"):
        pmodel.step(x, target=y)


# ---- sync_to ---------------------------------------------------------------------------------

def test_sync_to_refuses_a_meta_model_and_another_structure():
    _, pmodel, x, y = _one_device()
    with torch.device("meta"):
        meta = MLP()
    with pytest.raises(ValueError, match=r"the model's 'layers.0.weight' \(6 tensor\(s\) in all\) is on the meta device.*"
                                         r"model.to_empty\(device='cpu'\)"):
        pmodel.sync_to(meta)
    with pytest.raises(ValueError, match=r"the model differs: layers.0.weight \[64, 16\] here, \[64, 32\] trained"):
        pmodel.sync_to(MLP(d_in=16))
    with pytest.raises(TypeError, match=r"takes the torch.nn.Module pmodel was built from, got dict"):
        pmodel.sync_to({})


def _sync_job(rank, shape, names):
    torch.manual_seed(0)
    model = GPT(qkv_bias=False, layers=2, hidden=32)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    params = {id(p) for p in model.parameters()}
    x, y = make_batch("tokens", 8)
    pmodel = autopar.parallelize(model, autopar.Mesh(shape, axis_names=names), example_inputs=(x,), loss_fn=lm_loss,
                                 example_target=y, mode="auto")
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        pmodel.step(x, target=y)
        opt.step()
        opt.zero_grad()
    untouched = all(torch.equal(v, start[k]) for k, v in model.state_dict().items())
    pmodel.sync_to(model)
    full = pmodel.full_state_dict()
    return {"untouched": untouched, "same_tensors": {id(p) for p in model.parameters()} == params,
            "equal": sorted(full) == sorted(model.state_dict())
            and all(torch.equal(full[k], v) for k, v in model.state_dict().items()),
            "moved": not all(torch.equal(v, start[k]) for k, v in model.state_dict().items()),
            "pp": pmodel.plan.degrees["pp"]}


@pytest.mark.parametrize("shape, names", [((2,), ("tp",)), ((2,), ("pp",))])
def test_sync_to_copies_the_trained_state_into_the_original_model(shape, names):
    for r, res in enumerate(run_ranks(2, _sync_job, shape, names)):
        assert res["untouched"], f"rank {r}: training changed the original model"
        assert res["equal"] and res["moved"] and res["same_tensors"], (r, res)
    assert res["pp"] == (2 if names == ("pp",) else 1)
