"""``pmodel(x)`` returns the model's own output structure (tuple, dict, nested, Hugging Face
ModelOutput), every tensor leaf gathered in full; a loss_fn receives that structure too."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

import autopar
from conftest import run_ranks
from examples.models import GPT, lm_loss
from oracle import make_batch


class _Net(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        logits = self.fc2(h)
        if self.kind == "tuple":
            return logits, h, None
        if self.kind == "dict":
            return {"logits": logits, "hidden": h, "total": logits.sum(), "n": 3}
        return (logits, {"hidden": h, "probs": logits.softmax(-1)}, 7)


class _TupleGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.gpt = GPT(qkv_bias=False, layers=2, hidden=32)

    def forward(self, idx):
        logits = self.gpt(idx)
        return logits, logits.log_softmax(-1)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=32, use_cache=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return _gpt2() if kind == "hf" else _Net(kind)


def _input(kind: str) -> torch.Tensor:
    if kind == "hf":
        return make_batch("tokens", 4)[0]
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def _compare(got, want) -> dict:
    """Same structure (types, keys, non-tensor leaves) and the largest relative error of a tensor leaf."""
    g_leaves, g_spec = tree_flatten(got)
    w_leaves, w_spec = tree_flatten(want)
    err = 0.0
    same = g_spec == w_spec and type(got) is type(want)
    for g, w in zip(g_leaves, w_leaves):
        if isinstance(w, torch.Tensor):
            same &= isinstance(g, torch.Tensor) and g.shape == w.shape
            if same:
                err = max(err, float((g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-12)))
        else:
            same &= g == w
    return {"same": same, "err": err, "type": type(got).__name__,
            "keys": sorted(got) if isinstance(got, dict) else None}


def _run(rank, kind: str, n: int, mode: str):
    x = _input(kind)
    model = _model(kind)
    with torch.no_grad():
        want = model(x)
    pmodel = autopar.parallelize(model, autopar.Mesh(n), example_inputs=(x,), mode=mode)
    with torch.no_grad():
        return _compare(pmodel(x), want)


def _check(res: dict) -> None:
    assert res["same"], res
    assert res["err"] <= 1e-5, res


KINDS = ["tuple", "dict", "nested", pytest.param("hf", marks=pytest.mark.skipif(
    not __import__("importlib").util.find_spec("transformers"), reason="needs transformers"))]


@pytest.mark.parametrize("kind", KINDS)
def test_stand_alone_returns_model_structure(kind):
    res = _run(0, kind, 1, "stand_alone")
    _check(res)
    if kind == "hf":
        assert res["type"] == "CausalLMOutputWithCrossAttentions" and res["keys"] == ["logits"]


@pytest.mark.parametrize("kind", KINDS)
def test_data_parallel_returns_model_structure(kind):
    for res in run_ranks(2, _run, kind, 2, "data"):
        _check(res)


def _dict_loss(out, y):
    return F.cross_entropy(out["logits"], y)


def _dict_loss_job(rank):
    x, y = _input("dict"), torch.tensor([0, 1, 2, 3])
    pmodel = autopar.parallelize(_model("dict"), autopar.Mesh(2), example_inputs=(x,), loss_fn=_dict_loss,
                                 example_target=y, mode="data")
    return float(pmodel.step(x, target=y)), _compare(pmodel(x), _model("dict")(x))


def test_loss_fn_indexes_dict_output():
    x, y = _input("dict"), torch.tensor([0, 1, 2, 3])
    with torch.no_grad():
        ref = float(_dict_loss(_model("dict")(x), y))
    for loss, res in run_ranks(2, _dict_loss_job):
        assert abs(loss - ref) <= 1e-5 * abs(ref)
        _check(res)


def _tuple_loss(out, y):
    return lm_loss(out[0], y)


def _pipelined(rank):
    autopar.set_auto_parallel_context(schedule="gpipe", microbatches=2)
    x, y = make_batch("tokens", 8)
    torch.manual_seed(0)
    model = _TupleGPT()
    with torch.no_grad():
        want = model(x)
    mesh = autopar.Mesh((2,), axis_names=("pp",), device="a100-80gb")
    pmodel = autopar.parallelize(model, mesh, example_inputs=(x,), loss_fn=_tuple_loss, example_target=y,
                                 mode="auto")
    with torch.no_grad():
        res = _compare(pmodel(x), want)
    res["pp"] = pmodel.plan.degrees["pp"]
    return res


def test_pipelined_tuple_output():
    for res in run_ranks(2, _pipelined):
        assert res["pp"] == 2
        _check(res)


def test_old_plan_with_one_output_spec_still_works():
    x = _input("tuple")
    model = nn.Sequential(nn.Linear(8, 4))
    plan = autopar.plan(model, autopar.Mesh(1), example_inputs=(x,), mode="stand_alone")
    data = plan.to_dict()
    assert data["outputs"]["output"] == ["[R]"]
    data["outputs"]["output"] = "[R]"
    old = autopar.Plan.from_dict(data)
    assert [str(s) for s in old.output_specs()] == ["[R]"]
    got = autopar.parallelize(model, autopar.Mesh(1), example_inputs=(x,), plan=old)(x)
    assert torch.allclose(got, model(x))
