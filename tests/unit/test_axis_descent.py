"""The fitting start of big multi-axis intra-op problems (``solver/axis_descent.py``): a descent over the
mesh axes, the budgeted solve's hint, and the floor a time-limited answer never falls below."""
import dataclasses
import itertools

import numpy as np
import pytest

from autopar.solver import axis_descent
from autopar.solver.axis_descent import assess, axis_keys, descend, solve_with_start
from autopar.solver.brute_force import brute_force
from autopar.solver.greedy import feasible_hint
from autopar.solver.intra_op import DominatedError, EdgeCost, IntraOpProblem, NodeChoices, evaluate, solve_intra_op
from autopar.sharding.placements import R, Shard, Spec
from autopar.sharding.strategy import Strategy


def two_axis_problem(rng, n=8, per_axis=3, budget_share=None, ties=False) -> IntraOpProblem:
    """n nodes in a chain with skips; each node's strategies are the pairs (i, j) of per-axis choices,
    costs separable by axis plus noise (a mesh of two axes' products, as ``mesh_strategies`` forms)."""
    pairs = list(itertools.product(range(per_axis), repeat=2))
    keys = [np.array(pairs, dtype=np.int64) for _ in range(n)]
    nodes = []
    for v in range(n):
        a, b = rng.uniform(0, 1, per_axis), rng.uniform(0, 1, per_axis)
        m0, m1 = rng.uniform(1, 3, per_axis), rng.uniform(1, 3, per_axis)
        nodes.append(NodeChoices(f"n{v}", np.array([a[i] + b[j] + rng.uniform(0, 0.1) for i, j in pairs]),
                                 np.array([m0[i] * m1[j] for i, j in pairs])))
    edges = []
    for u in range(n):
        for v in (u + 1, u + 3):
            if v < n:
                r0, r1 = rng.uniform(0, 2, (per_axis, per_axis)), rng.uniform(0, 2, (per_axis, per_axis))
                np.fill_diagonal(r0, 0)
                np.fill_diagonal(r1, 0)
                edges.append(EdgeCost(u, v, np.array([[r0[i, k] + r1[j, m] for k, m in pairs] for i, j in pairs])))
    p = IntraOpProblem(nodes, edges, None, [[0, 4]] if ties else [], time_limit_s=10.0)
    if budget_share is not None:
        lo = sum(float(nd.memory.min()) for nd in nodes)
        hi = sum(float(nd.memory.max()) for nd in nodes)
        p.memory_budget = lo + budget_share * (hi - lo)
    p.axis_keys = keys
    p.hint = feasible_hint(p)
    return p


def test_axis_keys_name_each_axis_choice():
    s, r = Shard(0), R
    sts = [Strategy((Spec((s, r)),), Spec((s, r)), (None, None), "a"),
           Strategy((Spec((s, s)),), Spec((s, s)), (None, None), "b"),
           Strategy((Spec((r, s)),), Spec((r, s)), (None, "moe:ep"), "c"),
           Strategy((Spec((s, r)), Spec((r, r))), (Spec((s, r)), Spec((r, r))), (None, None), "d")]
    k = axis_keys([sts[:3], [sts[3]]])
    assert k[0].shape == (3, 2) and k[1].shape == (1, 2)
    assert k[0][0, 0] == k[0][1, 0] != k[0][2, 0]           # a and b agree on axis 0, c does not
    assert len({k[0][0, 1], k[0][1, 1], k[0][2, 1]}) == 3   # the local implementation counts
    assert k[1][0, 0] not in k[0][:, 0]                      # two inputs, two outputs: another choice


@pytest.mark.parametrize("seed", range(6))
def test_descent_fits_never_rises_and_is_a_feasible_assignment(seed):
    rng = np.random.default_rng(seed)
    p = two_axis_problem(rng, budget_share=0.4, ties=seed % 2 == 0)
    greedy = assess(p, p.hint, "greedy")
    start = descend(p, solve_intra_op, list(p.hint), deadline=1e18)
    assert start is not None
    objective, memory = evaluate(p, start.choice)
    assert objective == pytest.approx(start.objective) and memory <= p.memory_budget
    if greedy is not None:
        assert start.objective <= greedy.objective + 1e-12
    if seed % 2 == 0:
        assert start.choice[0] == start.choice[4]            # ties kept


def _slow_answer(p: IntraOpProblem, status: str):
    """A solve stopped by its time limit: replicate-all-like index 0 everywhere, not proven."""
    def solve(q):
        if q.axis_keys is None:           # the descent's restricted solves run for real
            return solve_intra_op(q)
        choice = [0] * len(q.nodes)
        objective, memory = evaluate(q, choice)
        sol = solve_intra_op(dataclasses.replace(q, time_limit_s=5.0, axis_keys=None))
        return dataclasses.replace(sol, choice=choice, objective=objective, memory=memory, status=status)
    return solve


def test_a_time_limited_answer_is_never_slower_than_the_start(monkeypatch):
    monkeypatch.setattr(axis_descent, "DESCENT_PAIRS", 0)
    monkeypatch.setattr(axis_descent, "free_first", lambda p: (None, None))   # the stub's answers count
    p = two_axis_problem(np.random.default_rng(3), budget_share=None)
    slow = evaluate(p, [0] * len(p.nodes))[0]
    greedy = evaluate(p, p.hint)[0]
    start = descend(p, solve_intra_op, list(p.hint), deadline=1e18)
    assert start.objective < min(slow, greedy)              # the case discriminates
    got = solve_with_start(p, _slow_answer(p, "FEASIBLE"))
    assert got.status == "FEASIBLE(start)"
    assert got.objective == pytest.approx(start.objective) and got.choice == start.choice
    # without the descent (a small problem) the greedy hint is the floor
    monkeypatch.setattr(axis_descent, "DESCENT_PAIRS", 10**9)
    got = solve_with_start(p, _slow_answer(p, "FEASIBLE"))
    assert got.objective == pytest.approx(min(slow, greedy))


def test_a_proven_optimum_is_kept(monkeypatch):
    monkeypatch.setattr(axis_descent, "DESCENT_PAIRS", 0)
    monkeypatch.setattr(axis_descent, "free_first", lambda p: (None, None))
    p = two_axis_problem(np.random.default_rng(4))
    got = solve_with_start(p, _slow_answer(p, "OPTIMAL"))     # (claimed) proven: not replaced
    assert got.choice == [0] * len(p.nodes) and got.status == "OPTIMAL"


@pytest.mark.parametrize("seed", range(8))
def test_the_plan_is_unchanged_where_the_solve_is_proven_optimal(monkeypatch, seed):
    monkeypatch.setattr(axis_descent, "DESCENT_PAIRS", 0)
    rng = np.random.default_rng(100 + seed)
    p = two_axis_problem(rng, n=5, per_axis=2, budget_share=[None, 0.5, 0.3][seed % 3], ties=seed % 2 == 1)
    plain = solve_intra_op(dataclasses.replace(p, axis_keys=None))
    started = solve_with_start(p)
    assert plain.status == started.status == "OPTIMAL"
    assert started.objective == pytest.approx(plain.objective, rel=1e-9)
    best = brute_force(p)
    assert started.objective == pytest.approx(evaluate(p, best.choice)[0], rel=1e-9)


@pytest.mark.slow
def test_deepseek_stand_in_plans_near_its_proven_optimum_where_the_limit_stops_cp_sat(monkeypatch):
    """A 6-layer DeepSeek-V3 (MLA, 16 experts) on dp 2 x ep 4: 600k strategy pairs; at a 10 s limit CP-SAT
    finds nothing and the plan used to be the greedy hint (2.7x the optimum on the 2-core VM)."""
    import torch
    import transformers as tf

    import autopar
    from autopar.solver import mesh_solve
    from examples.hf_zoo import LogitsOnly, lm_loss

    cfg = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
               num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1,
               n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=2,
               q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
               max_position_embeddings=1024, use_cache=False, attn_implementation="sdpa", bos_token_id=0,
               eos_token_id=0, pad_token_id=0)
    with torch.device("meta"):
        model = LogitsOnly(tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**cfg)))
    x = torch.zeros(16, 512, dtype=torch.long)
    seen = []
    started = mesh_solve.solve_with_start

    def record(p, solve):
        sol = started(p, solve)
        seen.append((p, sol))
        return sol

    monkeypatch.setattr(mesh_solve, "solve_with_start", record)
    autopar.reset_auto_parallel_context()
    try:
        autopar.set_auto_parallel_context(zero=1, solver_time_limit=10.0)
        mesh = autopar.Mesh((2, 4), axis_names=("dp", "ep"), device="h800", gpus_per_node=2)
        autopar.plan(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=x, mode="semi_auto",
                     mixed_precision="bf16")
    finally:
        autopar.reset_auto_parallel_context()
    assert len(seen) == 1
    p, sol = seen[0]
    assert axis_descent.wants_descent(p)
    best = solve_intra_op(dataclasses.replace(p, axis_keys=None, hint=None, time_limit_s=900.0))
    assert best.status == "OPTIMAL"
    greedy = evaluate(p, p.hint)[0]
    assert greedy > 1.5 * best.objective                     # the case discriminates
    assert sol.objective <= 1.02 * best.objective


def _tight(p: IntraOpProblem) -> tuple[IntraOpProblem, float]:
    """``p`` under a budget its unbudgeted optimum does not fit (above the memory floor), and that optimum."""
    free = solve_intra_op(dataclasses.replace(p, memory_budget=None))
    floor = sum(float(nd.memory.min()) for nd in p.nodes)
    assert floor < free.memory
    q = dataclasses.replace(p, memory_budget=(floor + free.memory) / 2)
    q.hint = feasible_hint(q)
    return q, free.objective


def _no_descent(*a, **k):
    raise AssertionError("the descent ran")


def test_a_free_optimum_that_fits_is_returned_without_the_descent(monkeypatch):
    monkeypatch.setattr(axis_descent, "DESCENT_PAIRS", 0)
    monkeypatch.setattr(axis_descent, "descend", _no_descent)
    monkeypatch.setattr(axis_descent, "data_start", _no_descent)
    p = two_axis_problem(np.random.default_rng(7), n=5, per_axis=2, budget_share=1.0)
    got = solve_with_start(p)
    assert got.status == "OPTIMAL" and got.free_bound == pytest.approx(got.objective)
    assert got.objective == pytest.approx(evaluate(p, brute_force(p).choice)[0], rel=1e-9)


def test_a_problem_that_cannot_beat_the_cutoff_is_dropped_before_the_descent(monkeypatch):
    monkeypatch.setattr(axis_descent, "DESCENT_PAIRS", 0)
    monkeypatch.setattr(axis_descent, "descend", _no_descent)
    monkeypatch.setattr(axis_descent, "data_start", _no_descent)
    p, free = _tight(two_axis_problem(np.random.default_rng(8)))
    with pytest.raises(DominatedError, match="cannot beat the best plan so far") as err:
        solve_with_start(dataclasses.replace(p, cutoff=free))
    assert err.value.unbudgeted and err.value.free_bound == pytest.approx(free)


def test_a_problem_under_the_cutoff_whose_optimum_does_not_fit_still_descends(monkeypatch):
    monkeypatch.setattr(axis_descent, "DESCENT_PAIRS", 0)
    calls = []
    real = axis_descent.descend
    monkeypatch.setattr(axis_descent, "descend", lambda *a, **k: calls.append(1) or real(*a, **k))
    p, free = _tight(two_axis_problem(np.random.default_rng(8)))
    got = solve_with_start(dataclasses.replace(p, cutoff=10 * free))
    assert calls and got.memory <= p.memory_budget
    assert got.objective >= free - 1e-9 and got.free_bound == pytest.approx(free)


def test_the_budgeted_solve_after_the_descent_reuses_the_free_optimum(monkeypatch):
    """``free_first``'s proven optimum reaches the budgeted solve (``IntraOpProblem.free``): the whole
    problem is solved without its budget once, not again after the descent."""
    from autopar.solver import intra_op

    monkeypatch.setattr(axis_descent, "DESCENT_PAIRS", 0)
    whole = []
    real = intra_op._solve
    p, free = _tight(two_axis_problem(np.random.default_rng(8)))
    monkeypatch.setattr(intra_op, "_solve", lambda q, *a, **k: (   # the free problem shares p's nodes
        whole.append(1) if q.memory_budget is None and q.nodes[0] is p.nodes[0] else None) or real(q, *a, **k))
    got = solve_with_start(dataclasses.replace(p, cutoff=10 * free))
    assert len(whole) == 1 and got.free_bound == pytest.approx(free)
    plain = solve_intra_op(dataclasses.replace(p, axis_keys=None))
    assert got.objective == pytest.approx(plain.objective, rel=1e-9) or got.objective < plain.objective
