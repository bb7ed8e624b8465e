"""Sequence parallelism (Megatron-SP) in the solver: a tensor-parallel GPT whose memory binds gets
its norms split along the sequence on the tp axis, while the same job without the cap does not; the
cost of SP's reduce-scatter + all-gather equals the all-reduce's it replaces (the gather's backward
is the reduce-scatter, ``solver/seq_parallel.py``); its gathered copies are counted in memory."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar import Shard
from autopar.cost_models.devices import get_device
from autopar.report.sequence_parallel import sequence_parallel
from autopar.sharding.placements import as_spec
from autopar.solver.strategy_prices import Costing, redistribution_time
from autopar.solver.seq_parallel import fused_gather_saving, gathered_copy_table
from cp_models import TinyGPT, token_loss, tokens


def _annotate_tp():
    autopar.shard("blocks.*.qkv", weight={"tp": Shard(0, 3)}, bias={"tp": Shard(0, 3)})
    autopar.shard("blocks.*.fc1", weight={"tp": Shard(0)}, bias={"tp": Shard(0)})
    autopar.shard("blocks.*.proj", weight={"tp": Shard(1)})
    autopar.shard("blocks.*.fc2", weight={"tp": Shard(1)})


def _plan(cap_bytes=None, sp=False):
    autopar.clear_annotations()
    autopar.reset_auto_parallel_context()
    autopar.set_auto_parallel_context(recompute="none", accumulation=1, zero=0)   # SP is the lever left
    _annotate_tp()
    if sp:
        autopar.op_strategy("blocks.*.ln*", tp="S1")
    x, y = tokens(2)
    kw = {"memory_gb": cap_bytes / 2**30} if cap_bytes else {}
    try:
        return autopar.plan(TinyGPT(), autopar.Mesh(2, axis_names=("tp",), device="cpu", **kw), example_inputs=(x,),
                            loss_fn=token_loss, example_target=y, mode="semi_auto")
    finally:
        autopar.clear_annotations()
        autopar.reset_auto_parallel_context()


def _block_norms(plan) -> list[str]:
    return [d.strategy for d in plan.nodes.values() if "layer_norm" in d.op and d.module.startswith("blocks.")]


def test_memory_cap_makes_the_tp_plan_sequence_parallel():
    free = _plan()
    forced = _plan(sp=True)
    assert sequence_parallel(free) == {}, _block_norms(free)
    assert all(s == "S1" for s in _block_norms(forced))
    # SP keeps less: the residual stream's saved norm inputs are split, the gathered linear inputs are not
    assert forced.memory_breakdown["activations"] < free.memory_breakdown["activations"]
    cap = (max(forced.memory_per_device) + max(free.memory_per_device)) / 2
    bound = _plan(cap_bytes=cap)
    assert max(bound.memory_per_device) <= cap
    assert all(s == "S1" for s in _block_norms(bound)), _block_norms(bound)
    assert sequence_parallel(bound)["tp"][:2] == ["blocks.*.ln1", "blocks.*.ln2"]
    assert "sequence parallel (sp) on tp" in bound.report() and "sequence parallel" not in free.report()


def test_sp_transition_costs_the_all_reduce_it_replaces():
    """Forward P -> S(1) (reduce-scatter) then S(1) -> R (all-gather) into a column-parallel op whose
    gradient the gather's reduce-scatter sums: forward and backward each the bytes of one all-reduce."""
    c = Costing((4,), get_device("a100-80gb"))
    nbytes = 8 * 1024 * 128 * 4.0
    ar = c.comm("all_reduce", nbytes, 0)
    # without SP: all-reduce forward (P -> R, identity backward) + the consumer's f all-reduce backward
    plain = redistribution_time(as_spec("[P]"), as_spec("[R]"), nbytes, c) + ar
    rs = redistribution_time(as_spec("[P]"), as_spec("[S(1)]"), nbytes, c)
    ag = redistribution_time(as_spec("[S(1)]"), as_spec("[R]"), nbytes, c)
    saving = fused_gather_saving(as_spec("[S(1)]"), as_spec("[R]"), {0}, nbytes, 1, c)
    sp = rs + ag + ar - saving
    assert saving == pytest.approx(ar - c.comm("reduce_scatter", nbytes, 0))
    assert sp == pytest.approx(plain, rel=0.05)
    # no saving where the consumer does not run split on the axis (no f), or takes it as it is
    assert fused_gather_saving(as_spec("[S(1)]"), as_spec("[R]"), set(), nbytes, 1, c) == 0.0
    assert fused_gather_saving(as_spec("[R]"), as_spec("[R]"), {0}, nbytes, 1, c) == 0.0


def test_gathered_copy_charged_beyond_the_piece():
    c = Costing((4,), get_device("a100-80gb"))
    table = gathered_copy_table((as_spec("[S(1)]"), as_spec("[R]")), (as_spec("[R]"), as_spec("[S(1)]")), 400.0, 2, c)
    # S(1) piece 100 B gathered to 400 B: 300 B more, shared by the 2 consumers that save it
    assert table.tolist() == [[150.0, 0.0], [0.0, 0.0]]
    assert gathered_copy_table((as_spec("[R]"),), (as_spec("[R]"),), 400.0, 1, c) is None


def test_sp_asked_for_a_dim_the_norm_cannot_split_is_a_clear_error():
    """``op_strategy`` naming a strategy the norms do not have (their normalised dim) names the target."""
    autopar.clear_annotations()
    _annotate_tp()
    autopar.op_strategy("blocks.*.ln*", tp="S2")
    x, y = tokens(2)
    try:
        with pytest.raises(ValueError, match=r"op_strategy\('blocks\.\*\.ln\*', tp='S2'\) matches no op"):
            autopar.plan(TinyGPT(), autopar.Mesh(2, axis_names=("tp",), device="cpu"), example_inputs=(x,),
                         loss_fn=token_loss, example_target=y, mode="semi_auto")
    finally:
        autopar.clear_annotations()


@pytest.mark.slow
def test_auto_under_a_memory_cap_chooses_tp_with_sp():
    """AUTO on 4 simulated A100s: without a cap the batch split wins (no tp, no sp); under a cap
    that the batch split does not fit, the tp plan it picks runs its norms sequence-parallel."""
    from examples.models import GPT, lm_loss

    def plan(cap_gb=None):
        with torch.device("meta"):
            model = GPT(vocab=2048, hidden=1024, heads=16, layers=4, seq=1024, dropout=0.1, qkv_bias=False)
        x = torch.randint(0, 2048, (8, 1024))
        kw = {"memory_gb": cap_gb} if cap_gb else {}
        return autopar.plan(model, autopar.Mesh(4, axis_names=("tp",), device="a100-80gb", **kw), example_inputs=(x,),
                            loss_fn=lm_loss, example_target=x, mode="auto")

    free = plan()
    assert free.degrees["tp"] == 1 and sequence_parallel(free) == {}
    bound = plan(0.5)
    assert max(bound.memory_per_device) <= 0.5 * 2**30 < max(free.memory_per_device)
    assert bound.degrees["tp"] > 1
    assert "blocks.*.ln1" in sequence_parallel(bound)["tp"], bound.report()
