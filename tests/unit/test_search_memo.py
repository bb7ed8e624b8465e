"""The search's exact shortcuts (``core/search_memo.py``: elimination's partial sums at their factors'
sizes, node kinds by interned strategy lists, memoised save rules and option texts) change no plan:
AUTO returns the same plan, field for field (degrees, microbatches, schedule, every node's strategy
and option costs, predicted step and memory, the alternatives), with them on and off, on jobs that
reach the pipeline search."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.core import search_memo
from autopar.cost_models import memory
from autopar.solver import decode
from examples import factories


def _hf_llama():
    from examples.hf_zoo import VOCAB, llama, lm_loss

    torch.manual_seed(0)
    x = torch.randint(0, VOCAB, (16, 32))
    return llama(layers=4, num_key_value_heads=2), (x,), lm_loss, x


def _plan_dict(job, mesh, monkeypatch, enabled: bool, **kw) -> dict:
    monkeypatch.setattr(search_memo, "ENABLED", enabled)
    model, inputs, loss, target = job()
    # CP-SAT's limit is wall time: room enough that no budgeted solve ends at it under load (docs/testing.md)
    autopar.set_auto_parallel_context(solver_time_limit=60.0)
    try:
        plan = autopar.plan(model, mesh, example_inputs=inputs, loss_fn=loss, example_target=target, mode="auto",
                            **kw)
    finally:
        autopar.reset_auto_parallel_context()
    d = plan.to_dict()
    d.pop("solve_time")          # seconds measured, not decided
    return d


def _fitting_times(d: dict) -> dict:
    """``d`` with its alternatives cut to (note, memory options, step) of those that fit."""
    alts = [(a["note"], a["memory_options"], a["step_time"]) for a in d["alternatives"] if a["fits"]]
    return {**d, "alternatives": alts}


def _same_plan(job, mesh, monkeypatch, ties_vary: bool = False, **kw) -> dict:
    """``ties_vary``: the job has candidates whose budgeted CP-SAT solve has several assignments of equal
    time, of which the portfolio returns one by its workers' timing (the same code, run three times on
    the capped job, listed 4466944 and 4467200 bytes for one alternative): their memory and the
    failed candidates' notes are not compared."""
    decode._DESCRIBED.clear()
    on = _plan_dict(job, mesh, monkeypatch, True, **kw)
    assert decode._DESCRIBED and len(memory._SAVED_ITEMS), "the memos were not used: the test compares nothing"
    off = _plan_dict(job, mesh, monkeypatch, False, **kw)
    if ties_vary:
        on, off = _fitting_times(on), _fitting_times(off)
    for key in on:
        assert on[key] == off[key], key
    assert on == off
    return on


def test_tiny_gpt_on_4_devices_plans_the_same_with_and_without_the_memos(monkeypatch):
    """A 2-layer GPT on 4 H100s, 2 per node: the search tries pp 2 pipelines and the flat meshes."""
    plan = _same_plan(lambda: factories.gpt(hidden=32, layers=2, heads=2, seq=32, batch=8, vocab=256),
                      autopar.Mesh(4, device="h100", gpus_per_node=2), monkeypatch)
    assert any("pp=" in a["note"] for a in plan["alternatives"]), "no pipeline candidate was solved"


@pytest.mark.slow
def test_gpt_on_4_devices_plans_the_same_with_and_without_the_memos(monkeypatch):
    """A 4-layer GPT on 4 H100s, 2 per node: pipelines of 2 and 4 stages."""
    plan = _same_plan(lambda: factories.gpt(hidden=64, layers=4, heads=4, seq=64, batch=16, vocab=2048),
                      autopar.Mesh(4, device="h100", gpus_per_node=2), monkeypatch)
    assert any("pp=" in a["note"] for a in plan["alternatives"]), "no pipeline candidate was solved"


@pytest.mark.slow
def test_gpt_under_a_cap_plans_the_same_with_and_without_the_memos(monkeypatch):
    """Under a cap that needs ZeRO, accumulation and recomputation (tests/unit/test_search_bounds.py's job)."""
    _same_plan(lambda: factories.gpt(hidden=64, layers=4, heads=4, seq=64, batch=16, vocab=2048),
               autopar.Mesh(2, device="v100-16gb", memory_gb=0.0045), monkeypatch, ties_vary=True)


@pytest.mark.slow
def test_bf16_gpt_on_8_devices_plans_the_same_with_and_without_the_memos(monkeypatch):
    plan = _same_plan(lambda: factories.gpt(hidden=128, layers=8, heads=4, seq=128, batch=16, vocab=4096),
                      autopar.Mesh(8, device="h100", gpus_per_node=4), monkeypatch, mixed_precision="bf16")
    assert any("pp=" in a["note"] for a in plan["alternatives"])


@pytest.mark.slow
def test_llama_on_4_devices_plans_the_same_with_and_without_the_memos(monkeypatch):
    """A Hugging Face Llama with grouped-query attention (2 key/value heads), as bench/search_speed.py plans."""
    plan = _same_plan(_hf_llama, autopar.Mesh(4, device="h100", gpus_per_node=2), monkeypatch)
    assert any("pp=" in a["note"] for a in plan["alternatives"])
