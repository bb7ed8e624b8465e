"""The model zoo (examples/hf_zoo.py, docs/zoo.md): every model trains on 2 ranks like one process.

Each case trains two steps of SGD with momentum on 2 CPU ranks and compares, at 1e-5 relative, the
losses, the gathered gradients before each step and the parameters after it with a single-device run
made here (tests/oracle.py's ``assert_same_training``). Models with attention key biases (BERT, ViT)
compare those parameters only within the whole-model vector: their true gradient is 0 (softmax
ignores a shift shared by all keys), so both runs move them by float noise. One rank call runs all
the modes of a model (the pools are shared; a fresh plan per case).

ZOO_TABLE is docs/zoo.md's table; ``test_docs_table_matches_the_tests`` keeps the two the same.
"""
from __future__ import annotations

import pathlib
import re

import pytest
import torch

import autopar
from conftest import run_ranks
from oracle import assert_same_training, make_optimizer

pytest.importorskip("transformers")

from examples.hf_zoo import NAMES, annotate_tensor_parallel, hf_model  # noqa: E402

STEPS, LR = 2, 0.05
MODES = ("data", "semi_auto", "auto")
# model -> mode -> "works" (the oracle passes) or the refusal's reason; docs/zoo.md shows the same.
ZOO_TABLE = {name: {mode: "works" for mode in MODES} for name in NAMES}
TENSOR_RTOL = {"bert": float("inf"), "vit": float("inf")}
KEY_BIAS = re.compile(r"(attention\.self\.key|attention\.k_proj)\.bias$")
FAST = {"gpt2": ("data", "semi_auto", "auto"), "t5": ("auto",), "bert": ("data",), "cnn": ("data",)}


def _mesh(mode):
    return autopar.Mesh(2, axis_names=("tp",)) if mode == "semi_auto" else autopar.Mesh(2)


def _train(step, model_params, named_grads, opt):
    out = {"losses": [], "grads": [], "params": []}
    for _ in range(STEPS):
        out["losses"].append(float(step()))
        out["grads"].append({k: v.clone() for k, v in named_grads().items()})
        opt.step()
        opt.zero_grad()
        out["params"].append({k: v.clone() for k, v in model_params().items()})
    return out


def _reference(name):
    torch.manual_seed(0)
    zm = hf_model(name)
    (args, kwargs), model = zm.inputs, zm.module
    opt = make_optimizer(model.parameters(), "sgd", LR)

    def step():
        loss = zm.loss_fn(model(*args, **kwargs), zm.target)
        loss.backward()
        return loss.detach()

    names = {id(p): n for n, p in model.named_parameters()}
    return _train(step, lambda: {k: v.detach() for k, v in model.state_dict().items()},
                  lambda: {names[id(p)]: p.grad for p in model.parameters() if p.grad is not None}, opt)


def _parallel(name, mode):
    torch.manual_seed(0)
    zm = hf_model(name)
    args, kwargs = zm.inputs
    autopar.clear_annotations()
    if mode == "semi_auto":
        annotate_tensor_parallel(name)
    pmodel = autopar.parallelize(zm.module, _mesh(mode), example_inputs=args, example_kwargs=kwargs,
                                 loss_fn=zm.loss_fn, example_target=zm.target, mode=mode)
    opt = make_optimizer(pmodel.parameters(), "sgd", LR)
    out = _train(lambda: pmodel.step(*args, target=zm.target, **kwargs), pmodel.full_state_dict,
                 pmodel.full_grad_dict, opt)
    out["degrees"] = pmodel.plan.degrees
    autopar.clear_annotations()
    return out


def _job(rank, name, modes):
    return {mode: _parallel(name, mode) for mode in modes}


def _without_key_biases(run, what):
    """``run`` with the attention key biases' gradients left out, after checking they are ~0 (float
    noise against the whole gradient) as their true value is."""
    grads = []
    for i, g in enumerate(run["grads"]):
        whole = torch.cat([v.flatten() for v in g.values()]).norm()
        for k in (k for k in g if KEY_BIAS.search(k)):
            assert g[k].norm() <= 1e-5 * whole, f"{what} grad {k} before step {i + 1} is not ~0"
        grads.append({k: v for k, v in g.items() if not KEY_BIAS.search(k)})
    return {**run, "grads": grads}


def _check(name, modes):
    ref = _without_key_biases(_reference(name), f"{name} single device")
    results = run_ranks(2, _job, name, modes)
    for r, res in enumerate(results):
        for mode in modes:
            what = f"{name} {mode} rank {r}"
            assert ZOO_TABLE[name][mode] == "works"
            assert_same_training(ref, _without_key_biases(res[mode], what), tensor_rtol=TENSOR_RTOL.get(name),
                                 what=what)
    return results[0]


@pytest.mark.parametrize("name", sorted(FAST))
def test_zoo_model_trains_like_one_process(name):
    res = _check(name, FAST[name])
    if "data" in res:
        assert res["data"]["degrees"]["dp"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_zoo_model_trains_like_one_process_in_every_mode(name):
    res = _check(name, MODES)
    assert res["data"]["degrees"]["dp"] == 2


def test_semi_auto_keeps_the_megatron_mlp_split():
    """The annotation is the plan's, not only accepted: GPT-2's c_fc (Conv1D, weight (in, out)) is
    split on its output features, c_proj on its input features."""
    zm = hf_model("gpt2")
    annotate_tensor_parallel("gpt2")
    plan = autopar.plan(zm.module, _mesh("semi_auto"), example_inputs=zm.inputs[0], loss_fn=zm.loss_fn,
                        example_target=zm.target, mode="semi_auto")
    for layer in range(2):
        mlp = f"inner.transformer.h.{layer}.mlp"
        assert str(plan.params[f"{mlp}.c_fc.weight"].spec) == "[S(1)]"
        assert str(plan.params[f"{mlp}.c_proj.weight"].spec) == "[S(0)]"


def test_unknown_zoo_model_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown zoo model 'gpt5': choose one of gpt2, bert"):
        hf_model("gpt5")
    with pytest.raises(ValueError, match=r"unknown zoo model 'gpt5'"):
        annotate_tensor_parallel("gpt5")


def test_docs_table_matches_the_tests():
    text = (pathlib.Path(__file__).parents[2] / "docs" / "zoo.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 1 + len(MODES) and re.fullmatch(r"`\w+`", cells[0]):
            rows[cells[0].strip("`")] = dict(zip(MODES, cells[1:]))
    assert rows == ZOO_TABLE
