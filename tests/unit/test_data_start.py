"""The data-parallel start of a mesh with several named data axes (``solver/data_start.py``): the
batch-split strategies it restricts each op to, and the solve it seeds, which a descent from the
greedy hint alone leaves stuck where one axis cannot change without the other."""
import dataclasses
import itertools

import numpy as np
import pytest

from autopar.solver import axis_descent
from autopar.solver.axis_descent import solve_with_start
from autopar.solver.data_start import batch_split_allowed, data_allowed, data_axes
from autopar.solver.greedy import feasible_hint
from autopar.solver.intra_op import EdgeCost, IntraOpProblem, NodeChoices, evaluate, solve_intra_op

R_, B_, H_ = 0, 1, 2          # per-axis choices: replicate, batch split, hidden split
PAIRS = list(itertools.product((R_, B_, H_), repeat=2))


def _compute(pair) -> float:
    """Per op: batch x batch 1.0, hidden x hidden 0.8 (a little cheaper), mixed 5.0, any replicate 2.0."""
    if R_ in pair:
        return 2.0
    if pair == (B_, B_):
        return 1.0
    return 0.8 if pair == (H_, H_) else 5.0


def _edge(per_axis_change: float) -> np.ndarray:
    return np.array([[per_axis_change * sum(x != y for x, y in zip(p, q)) for q in PAIRS] for p in PAIRS])


def stuck_problem(k: int = 2) -> IntraOpProblem:
    """input (batch x batch) -> k ops -> loss (takes batch x batch): going hidden x hidden costs 0.1 at the
    input and 0.5 at the loss, so the greedy hint goes hidden (0.9 < 1.0 at the first op), the optimum is
    batch x batch throughout (2.0 < 2.2), and no single-axis change leaves hidden x hidden (mixed costs 5)."""
    bb = PAIRS.index((B_, B_))
    nodes = [NodeChoices("input", np.zeros(len(PAIRS)), np.zeros(len(PAIRS)), [bb])]
    nodes += [NodeChoices(f"op{i}", np.array([_compute(p) for p in PAIRS]), np.ones(len(PAIRS))) for i in range(k)]
    nodes.append(NodeChoices("loss", np.zeros(len(PAIRS)), np.zeros(len(PAIRS)), [bb]))
    edges = [EdgeCost(v, v + 1, _edge(0.25 if v == k else 0.05)) for v in range(k + 1)]
    p = IntraOpProblem(nodes, edges, None, [], time_limit_s=10.0)
    p.axis_keys = [np.array(PAIRS, dtype=np.int64) for _ in nodes]
    p.hint = feasible_hint(p)
    return p


def _stopped_early(q):
    """The whole problem's solve stopped by its time limit with its hint (not proven); the descent's and
    the data start's restricted solves run for real."""
    if q.axis_keys is None:
        return solve_intra_op(q)
    objective, memory = evaluate(q, list(q.hint))
    return dataclasses.replace(solve_intra_op(dataclasses.replace(q, axis_keys=None)), choice=list(q.hint),
                               objective=objective, memory=memory, status="FEASIBLE")


def _needs_search(monkeypatch):
    """The whole problem as one whose free solve needs CP-SAT (``_stopped_early`` stands for it): the
    elimination decides nothing before the descent (``axis_descent.free_first``)."""
    monkeypatch.setattr(axis_descent, "DESCENT_PAIRS", 0)
    monkeypatch.setattr(axis_descent, "free_first", lambda p: (None, None))


def test_the_data_start_leaves_the_local_optimum_the_descent_stays_in(monkeypatch):
    _needs_search(monkeypatch)
    p = stuck_problem()
    optimum = solve_intra_op(dataclasses.replace(p, axis_keys=None))
    assert optimum.status == "OPTIMAL" and optimum.objective == pytest.approx(2.0)
    hh = PAIRS.index((H_, H_))
    assert p.hint[1:-1] == [hh, hh]                          # the case discriminates: greedy goes hidden,
    without = solve_with_start(p, _stopped_early)            # and the descent cannot leave it
    assert without.objective == pytest.approx(2.2)
    names = [n.name for n in p.nodes]
    bb = PAIRS.index((B_, B_))
    p.data_allowed = data_allowed(names, {f"op{i}": [bb] for i in range(2)})
    got = solve_with_start(p, _stopped_early)
    assert got.objective == pytest.approx(2.0) and got.choice == [bb] * 4


def test_on_a_smaller_problem_the_data_start_is_the_floor_of_an_unproven_answer(monkeypatch):
    monkeypatch.setattr(axis_descent, "DESCENT_PAIRS", 10**9)       # no descent
    p = stuck_problem()
    bb = PAIRS.index((B_, B_))
    p.data_allowed = data_allowed([n.name for n in p.nodes], {f"op{i}": [bb] for i in range(2)})
    got = solve_with_start(p, _stopped_early)
    assert got.status == "FEASIBLE(start)" and got.objective == pytest.approx(2.0)
    proven = solve_with_start(p)                                     # proven: the solve's own answer
    assert proven.status == "OPTIMAL" and proven.objective == pytest.approx(2.0)


def test_without_a_data_start_nothing_changes(monkeypatch):
    _needs_search(monkeypatch)
    p = stuck_problem()
    assert data_allowed([n.name for n in p.nodes], {}) is None and p.data_allowed is None
    assert solve_with_start(p, _stopped_early).choice == p.hint


def test_batch_split_allowed_keeps_each_batch_op_split_on_every_data_axis():
    """A small GPT on dp 2 x ep 2 x tp 2: the named data axes are "dp" and "ep" ("tp" is left free); every
    op whose output carries the batch gets a non-empty list, each strategy Shard(batch dim) on both."""
    from examples import factories
    from autopar import Mesh
    from autopar.frontend.trace import trace
    from autopar.sharding.candidates import build_candidates
    from autopar.sharding.placements import Shard
    from autopar.solver.degrees import _batch_dims

    model, inputs, loss, target = factories.gpt(hidden=32, layers=1, heads=2, seq=8, batch=8, vocab=64)
    traced = trace(model, inputs, loss, target)
    mesh = Mesh((2, 2, 2), axis_names=("dp", "ep", "tp"))
    assert data_axes(mesh) == [0, 1]
    cands = build_candidates(traced.gm, mesh.shape)
    split = batch_split_allowed(traced, cands, mesh, {})
    bdims = _batch_dims(traced.gm, {ph: None for ph in [*traced.inputs, traced.target]})
    ops = [n for n in traced.gm.graph.nodes if n.op == "call_function" and (n.name, None) in bdims
           and n.name in cands.strategies]
    assert len(ops) > 10 and {n.name for n in ops} <= set(split)
    linears = [n for n in ops if "linear" in str(n.target) or "mm" in str(n.target)]
    assert linears
    for n in ops:
        d = bdims[(n.name, None)]
        for i in split[n.name]:
            out = cands.strategies[n.name][i].output
            assert all(isinstance(out[a], Shard) and out[a].dim % n.meta["val"].dim() == d for a in (0, 1)), \
                (n.name, cands.strategies[n.name][i].describe())
    assert batch_split_allowed(traced, cands, Mesh((2, 4), axis_names=("dp", "tp")), {}) is None   # one data axis
    assert batch_split_allowed(traced, cands, Mesh((2, 2, 2)), {}) is None                          # unnamed


def _deepseek_stand_in_plan(shape: tuple, names: tuple, layers: int = 4, microbatches: int = 8):
    """DeepSeek-V3's dimensions (hidden 7168, 256 experts, MLA) at ``layers`` layers on the meta device,
    1 sequence of 4096 tokens per data-parallel rank and microbatch, bf16, ZeRO-1, no recomputation."""
    import torch
    import transformers as tf

    import autopar
    from bench.moe_table import DEEPSEEK_V3
    from examples.hf_zoo import LogitsOnly, lm_loss

    cfg = tf.DeepseekV3Config(**{**DEEPSEEK_V3, "num_hidden_layers": layers, "first_k_dense_replace": 1},
                              use_cache=False, attn_implementation="sdpa", bos_token_id=0, eos_token_id=0,
                              pad_token_id=0)
    with torch.device("meta"):
        model = LogitsOnly(tf.DeepseekV3ForCausalLM(cfg))
    x = torch.zeros(microbatches * int(np.prod(shape[1:])), 4096, dtype=torch.long)
    autopar.reset_auto_parallel_context()
    autopar.clear_annotations()
    try:
        autopar.set_auto_parallel_context(zero=1, recompute="none", microbatches=microbatches)
        mesh = autopar.Mesh(shape, axis_names=names, device="h800", gpus_per_node=8)
        return autopar.plan(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=x, mode="semi_auto",
                            mixed_precision="bf16")
    finally:
        autopar.reset_auto_parallel_context()


@pytest.mark.slow
def test_deepseek_two_hop_stand_in_splits_the_batch_on_all_three_data_axes():
    """The two-hop row's layout at 4 layers and pp 2: pp x dp 2 x expert 8 x ep 8. Every dense linear layer
    but the head is split by tokens over dp x expert x ep = 128, nearly all by the batch (before: the
    greedy start's descent stopped at a layout with the batch gathered on some axes and the hidden dim
    split, ``dp=1 tp=128`` reported on the one-hop mesh, 3.18 s against 1.86 s), and the two-hop plan is
    no slower than the one-hop one (the same dense layout, fewer InfiniBand bytes)."""
    from autopar.sharding.placements import Shard

    two = _deepseek_stand_in_plan((2, 2, 8, 8), ("pp", "dp", "expert", "ep"))
    one = _deepseek_stand_in_plan((2, 2, 64), ("pp", "dp", "ep"))
    assert two.degrees["dp"] == 128 and two.degrees["ep"] == 64, two.degrees
    assert one.degrees["dp"] == 128 and one.degrees["ep"] == 64, one.degrees
    dense = {n: d for n, d in two.nodes.items() if d.op.startswith("aten.linear") and ".experts" not in d.module
             and not d.module.endswith("lm_head")}       # the head may split its 129k-row vocabulary instead
    assert len(dense) > 20
    for n, d in dense.items():       # split by tokens (batch, or sequence where a time-limited solve moves one)
        out = d.output[0] if isinstance(d.output, list) else d.output
        assert all(isinstance(p, Shard) and p.dim in (0, 1) for p in list(out)[-3:]), (n, d.module, str(out))
    assert sum(all(p.dim == 0 for p in list(d.output)[-3:]) for d in dense.values()) >= 0.9 * len(dense)
    assert two.step_time <= one.step_time * 1.0001, (two.step_time, one.step_time)
