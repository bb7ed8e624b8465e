"""Keyword and None inputs (``example_kwargs``, autopar/frontend/call_inputs.py): a model whose forward takes an
optional mask keyword trains like one process under a DATA plan and a pipeline with
``pmodel.step(x, target=y, mask=m)``; a tiny Hugging Face T5 trains called by keywords only; None and
constants are traced in, may be left out, and any other value at run time is refused clearly."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from conftest import run_ranks
from oracle import _train, assert_same_training, make_batch

STEPS = 3


class MaskedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(32, 64), nn.Linear(64, 64)])
        self.head = nn.Linear(64, 10)

    def forward(self, x, mask=None, scale=1.0):
        h = torch.relu(self.layers[1](torch.relu(self.layers[0](x))))
        out = self.head(h if mask is None else h * mask)      # on the last pipeline stage
        return out * scale


def _data(batch: int = 8):
    x, y = make_batch("vector", batch)
    mask = (torch.rand(batch, 64, generator=torch.Generator().manual_seed(2)) > 0.3).float()
    return x, y, mask


def _reference(batch: int):
    x, y, mask = _data(batch)
    torch.manual_seed(0)
    model = MaskedMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    names = {id(p): n for n, p in model.named_parameters()}

    def step(_):
        loss = F.cross_entropy(model(x, mask=mask, scale=2.0), y)
        loss.backward()
        return loss.detach()

    out = _train(step, lambda: {k: v.detach() for k, v in model.state_dict().items()},
                 lambda: {names[id(p)]: p.grad for p in model.parameters() if p.grad is not None}, opt, STEPS)
    out["output"] = model(x, mask=mask, scale=2.0).detach()
    return out


def _masked_job(rank, mesh, mode, batch, stage_tag):
    x, y, mask = _data(batch)
    torch.manual_seed(0)
    model = MaskedMLP()
    if stage_tag:
        autopar.pipeline_stage(model.layers[1], 1)
    pmodel = autopar.parallelize(model, mesh, example_inputs=(x,), example_kwargs={"mask": mask, "scale": 2.0},
                                 loss_fn=F.cross_entropy, example_target=y, mode=mode)
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.05, momentum=0.9)
    out = _train(lambda _: pmodel.step(x, target=y, mask=mask), pmodel.full_state_dict, pmodel.full_grad_dict,
                 opt, STEPS)                      # scale left out: the traced 2.0 holds
    out["output"] = pmodel(x, mask=mask, scale=2.0).detach()
    out["degrees"] = pmodel.plan.degrees
    return out


@pytest.mark.parametrize("shape,names,mode,stage_tag", [((2,), None, "data", False),
                                                        ((2,), ("pp",), "semi_auto", True)])
def test_keyword_mask_trains_like_one_process(shape, names, mode, stage_tag):
    ref = _reference(8)
    mesh = autopar.Mesh(shape, axis_names=names) if names else autopar.Mesh(shape)
    for r, res in enumerate(run_ranks(2, _masked_job, mesh, mode, 8, stage_tag)):
        assert res["degrees"]["pp" if stage_tag else "dp"] == 2, res["degrees"]
        assert_same_training(ref, res, what=f"{mode} rank {r}")
        torch.testing.assert_close(res["output"], ref["output"], rtol=1e-5, atol=1e-6)


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4,
                   dropout_rate=0.0, use_cache=False, decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return T5ForConditionalGeneration(cfg)


def _t5_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (4, 8), generator=g)
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[:, -2:] = 0
    kwargs = {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": torch.randint(1, 64, (4, 6), generator=g)}
    return kwargs, torch.randint(0, 64, (4, 6), generator=g)


def _t5_loss(out, y):
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def _t5_job(rank):
    kwargs, y = _t5_batch()
    pmodel = autopar.parallelize(_t5(), autopar.Mesh(2), example_kwargs=kwargs, loss_fn=_t5_loss, example_target=y,
                                 mode="data")
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.05, momentum=0.9)
    out = _train(lambda _: pmodel.step(target=y, **kwargs), pmodel.full_state_dict, pmodel.full_grad_dict, opt, 2)
    out["logits"] = pmodel(**kwargs).logits.detach()
    return out


def test_hugging_face_t5_called_by_keywords_trains_like_one_process():
    kwargs, y = _t5_batch()
    model = _t5()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(_):
        loss = _t5_loss(model(**kwargs), y)
        loss.backward()
        return loss.detach()

    ref = _train(step, lambda: {k: v.detach() for k, v in model.state_dict().items()},
                 lambda: {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, opt, 2)
    logits = model(**kwargs).logits.detach()
    for r, res in enumerate(run_ranks(2, _t5_job)):
        assert_same_training(ref, res, what=f"T5 rank {r}")
        torch.testing.assert_close(res["logits"], logits, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def one_device():
    """Modules on one device (no processes): planned with a mask keyword, and with None in its place."""
    x, y, mask = _data()
    torch.manual_seed(0)
    model = MaskedMLP()
    common = dict(loss_fn=F.cross_entropy, example_target=y)
    with_mask = autopar.parallelize(model, autopar.Mesh(1), example_inputs=(x,),
                                    example_kwargs={"mask": mask, "scale": 2.0}, **common)
    none_kw = autopar.parallelize(model, autopar.Mesh(1), example_inputs=(x,), example_kwargs={"mask": None}, **common)
    none_pos = autopar.parallelize(model, autopar.Mesh(1), example_inputs=(x, None), **common)
    return model, x, mask, with_mask, none_kw, none_pos


def test_none_inputs_are_traced_in_and_may_be_left_out(one_device):
    model, x, mask, with_mask, none_kw, none_pos = one_device
    want = model(x).detach()
    for got in (none_kw(x), none_kw(x, mask=None), none_pos(x), none_pos(x, None)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert "mask" not in [n.name for n in none_kw.program.gm.graph.nodes if n.op == "placeholder"]
    torch.testing.assert_close(with_mask(x, mask=mask), model(x, mask=mask, scale=2.0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("which,args,kwargs,error,message", [
    ("none_kw", (), {"mask": "m"}, ValueError,
     r"keyword 'mask' was planned as the constant None \(traced into the program\) but got a Tensor; pass None "
     r"\(or leave it out\), or re-plan with example_kwargs\['mask'\] set to what you pass"),
    ("none_pos", ("m",), {}, ValueError, r"input 1 was planned as the constant None .* example_inputs\[1\]"),
    ("with_mask", (), {"mask": "m", "scale": 3.0}, ValueError,
     r"keyword 'scale' was planned as the constant 2.0 \(traced into the program\) but got 3.0"),
    ("with_mask", (), {}, ValueError, r"keyword 'mask' was planned as a tensor but was not given; pass mask=<tensor>"),
    ("with_mask", (), {"mask": None}, TypeError, r"keyword 'mask' must be a tensor \(it was planned as one\), got "
                                                 r"NoneType"),
    ("with_mask", (), {"mask": "m", "bias": 1}, ValueError,
     r"got keyword\(s\) 'bias' that the model was not planned with \(planned: 'mask', 'scale'\); re-plan with "
     r"example_kwargs naming them"),
    ("with_mask", ("m",), {}, ValueError, r"the model was planned with 1 input\(s\) but got 2"),
])
def test_a_call_unlike_the_planned_one_is_refused_clearly(one_device, which, args, kwargs, error, message):
    model, x, mask, with_mask, none_kw, none_pos = one_device
    pmodel = {"with_mask": with_mask, "none_kw": none_kw, "none_pos": none_pos}[which]
    args = tuple(mask if a == "m" else a for a in args)
    kwargs = {k: mask if v == "m" else v for k, v in kwargs.items()}
    with pytest.raises(error, match=message):
        pmodel(x, *args, **kwargs)
    with pytest.raises(error, match=message):
        pmodel.step(x, *args, target=make_batch("vector", 8)[1], **kwargs)


def test_keyword_mismatch_in_shape_names_the_keyword(one_device):
    _, x, mask, with_mask, _, _ = one_device
    with pytest.raises(ValueError, match=r"keyword 'mask' has shape \[8, 32\] but the model was planned for the "
                                         r"global shape \[8, 64\]"):
        with_mask(x, mask=mask[:, :32])


@pytest.mark.parametrize("inputs,kwargs,error,message", [
    ((), {"target": torch.ones(8)}, ValueError,
     r"example_kwargs has the keyword 'target', which pmodel.step\(...\) and pmodel\(...\) take themselves"),
    ((), {"mask": {"a": torch.ones(8)}}, TypeError,
     r"example_kwargs\['mask'\] is a dict; every example input must be a tensor, None or a plain constant"),
    ((), {"mask": None}, ValueError, r"the example inputs hold no tensor: pass at least one tensor"),
    ((), [torch.ones(8)], TypeError, r"example_kwargs must be a dict of keyword name -> tensor"),
])
def test_bad_example_kwargs_are_refused_clearly(inputs, kwargs, error, message):
    with pytest.raises(error, match=message):
        autopar.plan(MaskedMLP(), autopar.Mesh(2), example_inputs=inputs, example_kwargs=kwargs)
