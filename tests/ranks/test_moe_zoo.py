"""Hugging Face mixture-of-experts families (examples/hf_moe_zoo.py, docs/zoo.md "Mixture of experts")
train on 4 ranks in DATA and AUTO like one process.

Each case: two SGD-with-momentum steps of the tiny model (4 experts, 2 per token) on 4 CPU ranks,
compared with a one-process run made here (losses, gathered gradients before each step, parameters
after it) at 1e-5 relative (tests/oracle.py's ``assert_same_training``).
DeepSeek-V3 uses sdpa with ``num_key_value_heads < num_attention_heads``: the config whose trace used
to fail (frontend/latent_attention.py).
"""
from __future__ import annotations

import pathlib
import re

import pytest
import torch

import autopar
from conftest import _fresh_call, _pool
from oracle import assert_same_training, parallel_run, reference_run

pytest.importorskip("transformers")

from examples.hf_moe_zoo import MOE_NAMES, moe_model  # noqa: E402

RANK_LIMIT_S = 900     # 4 ranks each tracing and planning a MoE model on a shared 2-core machine
WORLD, STEPS = 4, 2
MODES = ("data", "auto")
# family -> mode -> "works" (the oracle at 1e-5 passes); docs/zoo.md's MoE table shows the same.
MOE_TABLE = {name: {mode: "works" for mode in MODES} for name in MOE_NAMES}
FAST = {"deepseek_v3": ("data",)}   # its trace (MLA, group-limited routing) by default; every mode slow


def _build(name):
    def make():
        return moe_model(name).module
    zm = moe_model(name)
    return make, zm.loss_fn, zm.inputs[0][0], zm.target


def _job(rank, name, modes):
    make, loss_fn, x, y = _build(name)
    out = {mode: parallel_run(rank, make, loss_fn, x, y, autopar.Mesh(WORLD), mode, steps=STEPS) for mode in modes}
    return out


def _check(name, modes):
    make, loss_fn, x, y = _build(name)
    ref = reference_run(make, loss_fn, x, y, steps=STEPS)
    results = _pool(WORLD).run(_fresh_call, _job, name, modes, timeout_s=RANK_LIMIT_S)
    for r, res in enumerate(results):
        for mode in modes:
            what = f"{name} {mode} rank {r}"
            assert MOE_TABLE[name][mode] == "works"
            assert_same_training(ref, res[mode], what=what)
    return results[0]


@pytest.mark.parametrize("name", sorted(FAST))
def test_moe_family_trains_like_one_process(name):
    res = _check(name, FAST[name])
    assert res["data"]["degrees"]["dp"] == WORLD


@pytest.mark.slow
@pytest.mark.parametrize("name", MOE_NAMES)
def test_moe_family_trains_like_one_process_in_data_and_auto(name):
    res = _check(name, MODES)
    assert res["data"]["degrees"]["dp"] == WORLD


def test_docs_moe_table_matches_the_tests():
    text = (pathlib.Path(__file__).parents[2] / "docs" / "zoo.md").read_text()
    section = text.split("## Mixture of experts", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 1 + len(MODES) and re.fullmatch(r"`\w+`", cells[0]):
            rows[cells[0].strip("`")] = dict(zip(MODES, cells[1:]))
    assert rows == MOE_TABLE
