"""A plan that succeeds prints only autopar's own lines: its progress line and the report.

torch's fake-tensor mode logs an ERROR with a traceback for every op whose meta kernel fails (a CPU
``histc`` of int32 counts, as Hugging Face's grouped-mm experts record on a meta-device model; fp32
``torch._grouped_mm``), which used to flood stderr while autopar's cost model probed the op and
costed it another way (core/quiet_logs.py). Here ``autopar.plan(..., progress=True)`` runs over the
model zoo (docs/zoo.md), the MoE families and a torchtitan-style layer with stderr and stdout
captured: stderr holds only "planning: ..." progress segments, stdout only the printed report.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import autopar
from oracle import make_batch

pytest.importorskip("transformers")

from examples.hf_moe_zoo import MOE_NAMES, moe_model  # noqa: E402
from examples.hf_zoo import NAMES, hf_model  # noqa: E402

WORLD = 4
OWN = re.compile(r"planning: |\s*\| \d+ candidates \| ")    # the progress line (tqdm's bar or its own)


def _plan_quietly(capfd, model, args, kwargs, loss_fn, target, mode="auto"):
    capfd.readouterr()
    plan = autopar.plan(model, autopar.Mesh(WORLD), example_inputs=args, example_kwargs=kwargs or None,
                        loss_fn=loss_fn, example_target=target, mode=mode, progress=True)
    print(plan.report())
    out, err = capfd.readouterr()
    foreign = [s for s in re.split(r"[\r\n]+", err) if s.strip() and not OWN.match(s)]
    assert not foreign, f"{len(foreign)} lines on stderr that are not autopar's, first: {foreign[:3]}"
    assert out == plan.report() + "\n"
    return plan


def _mixtral_on_meta():
    """HF Mixtral with 8 experts, hidden 512, on the meta device: its experts count tokens with an
    int32 ``histc`` (the device is not "cpu"), whose CPU meta kernel refuses int32."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from examples.hf_moe_zoo import MoELM

    config = MixtralConfig(vocab_size=128, hidden_size=512, intermediate_size=256, num_hidden_layers=1,
                           num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                           max_position_embeddings=32, use_cache=False, attn_implementation="eager")
    with torch.device("meta"):
        return MoELM(MixtralForCausalLM(config), aux=False)


def test_planning_mixtral_on_meta_prints_no_torch_logs(capfd):
    x, y = make_batch("tokens", 4)
    plan = _plan_quietly(capfd, _mixtral_on_meta(), (x,), {}, lambda o, t: F.cross_entropy(o.flatten(0, 1),
                                                                                           t.flatten()), y, "data")
    assert plan.degrees


def test_planning_a_torchtitan_moe_prints_no_torch_logs(capfd):
    from test_moe_titan import DIM, Net

    x, y = make_batch("vector", 16, d_in=DIM)
    _plan_quietly(capfd, Net("grouped_mm"), (x,), {}, F.cross_entropy, y)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_planning_the_zoo_prints_no_torch_logs(capfd, name):
    zm = hf_model(name)
    _plan_quietly(capfd, zm.module, zm.inputs[0], zm.inputs[1], zm.loss_fn, zm.target)


@pytest.mark.slow
@pytest.mark.parametrize("name", MOE_NAMES)
def test_planning_moe_families_prints_no_torch_logs(capfd, name):
    zm = moe_model(name)
    _plan_quietly(capfd, zm.module, zm.inputs[0], zm.inputs[1], zm.loss_fn, zm.target)
