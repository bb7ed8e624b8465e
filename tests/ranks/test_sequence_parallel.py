"""Sequence parallelism (Megatron-SP, issue 35 part 2): in a tensor-parallel GPT the layer norms and
residual adds run split along the sequence on the tp axis (``autopar.op_strategy(glob, tp="S1")``),
the row-parallel linears' partial sums leave by reduce-scatter and the column-parallel linears take
their input by an all-gather whose backward is a reduce-scatter. Through the oracle (loss, gathered
gradients before every SGD step, parameters after it at 1e-5 against one device), and the plan's
collective list is what a step runs: reduce-scatters and all-gathers where the block's all-reduces were."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import autopar
from autopar import Shard
import conftest
from cp_models import TinyGPT, token_loss, tokens
from oracle import assert_same_training, parallel_run, reference_run

BATCH = 2


def run_ranks(n: int, fn, *args) -> list:
    """``conftest.run_ranks`` with room for a loaded machine (each rank plans and trains)."""
    return conftest._pool(n).run(conftest._fresh_call, fn, *args, timeout_s=600)


def annotate_tp(sp: bool, axis: str = "tp"):
    """Megatron's tensor-parallel GPT block (qkv and fc1 column-parallel, proj and fc2 row-parallel);
    ``sp``: with the norms (and so the residual stream between them) split along the sequence."""
    autopar.shard("blocks.*.qkv", weight={axis: Shard(0, 3)}, bias={axis: Shard(0, 3)})
    autopar.shard("blocks.*.fc1", weight={axis: Shard(0)}, bias={axis: Shard(0)})
    autopar.shard("blocks.*.proj", weight={axis: Shard(1)})
    autopar.shard("blocks.*.fc2", weight={axis: Shard(1)})
    if sp:
        autopar.op_strategy("blocks.*.ln*", **{axis: "S1"})


def _counted_step(x, y):
    def inspect(pmodel):
        with autopar.count_collectives() as counter:
            pmodel.step(x, target=y)
        plan = pmodel.plan
        placeholders = {d.placeholder for d in plan.params.values()}
        ran = [(k, a, nbytes) for k, nbytes, ax, _ in counter.calls for a in ax.split("+")]
        planned = [(c.kind, a, c.bytes, c.node in placeholders) for c in plan.collectives(torch.distributed.get_rank())
                   if c.phase != "step" for a in c.axes]
        return {"ran": ran, "planned": planned}
    return inspect


def _job(rank, shape, names, sp):
    x, y = tokens(BATCH)
    mesh = autopar.Mesh(shape, axis_names=names)

    def setup(model):
        annotate_tp(sp and "dp" not in names)
        if "dp" in names:       # the norms batch-split on dp and sequence-split on tp
            autopar.op_strategy("blocks.*.ln*", dp="S0", tp="S1")
    return parallel_run(rank, TinyGPT, token_loss, x, y, mesh, "semi_auto", setup=setup,
                        inspect=_counted_step(x, y))


def _activation_collectives(entries) -> Counter:
    """(kind, axis) -> count of the entries that are not gradient sync."""
    return Counter((k, a) for k, a, _, sync in entries if not sync)


def _check(shape, names, sp=True):
    x, y = tokens(BATCH)
    ref = reference_run(TinyGPT, token_loss, x, y)
    results = run_ranks(int(torch.tensor(shape).prod()), _job, shape, names, sp)
    for rank, r in enumerate(results):
        assert_same_training(ref, r, what=f"sp {shape} rank {rank}")
        ins = r["inspect"]
        ran_bytes, planned_bytes = Counter(), Counter()
        for k, a, b in ins["ran"]:
            ran_bytes[(k, a)] += b
        for k, a, b, _ in ins["planned"]:
            planned_bytes[(k, a)] += b
        assert ran_bytes == planned_bytes, f"rank {rank}: bytes planned {planned_bytes} ran {ran_bytes}"
    return results


def test_gpt_tp2_sequence_parallel_trains_like_one_device():
    results = _check((2,), ("tp",))
    plan = autopar.Plan.from_json(results[0]["plan"])
    norms = [d for d in plan.nodes.values() if "layer_norm" in d.op and d.module.startswith("blocks.")]
    assert norms and all(d.strategy == "S1" for d in norms), [(d.module, d.strategy) for d in norms]
    acts = _activation_collectives(results[0]["inspect"]["planned"])
    layers = 2
    # per block: 2 reduce-scatters out of the row-parallel linears (forward), 2 all-gathers into the
    # column-parallel ones (forward), their conjugates in backward; no all-reduce of an activation
    assert acts[("reduce_scatter", "tp")] >= 4 * layers, acts
    assert acts[("all_gather", "tp")] >= 4 * layers, acts
    assert acts[("all_reduce", "tp")] == 0, acts
    assert "sequence parallel (sp) on tp: norms split along the sequence (blocks.*.ln1, blocks.*.ln2" in plan.report()




@pytest.mark.slow
def test_gpt_dp2_tp2_sequence_parallel_trains_like_one_device():
    results = _check((2, 2), ("dp", "tp"))
    plan = autopar.Plan.from_json(results[0]["plan"])
    assert plan.degrees["dp"] == 2 and plan.degrees["tp"] == 2
    acts = _activation_collectives(results[0]["inspect"]["planned"])
    assert acts[("reduce_scatter", "tp")] >= 8 and acts[("all_reduce", "tp")] == 0, acts
