"""The solver's exact shortcuts of the twenty-first session (``core/search_memo.py`` switch): axis keys once
per Strategy object (``axis_descent._axis_keys_shared``), candidate masks by index (``class_graph.allowed_mask``),
the memory floor and ``evaluate`` in one numpy pass, class edges picked once per shared table
(``intra_op._map_edges``), restricted descent problems sharing their lists. Each gives the same values as the
plain code; AUTO returns the same plan with them on and off on small jobs whose solves run the axis descent."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import autopar
from autopar.core import search_memo
from autopar.frontend.trace import trace
from autopar.sharding.candidates import build_candidates
from autopar.solver import axis_descent, intra_op
from autopar.solver.axis_descent import axis_keys, descend
from autopar.solver.class_graph import allowed_mask
from autopar.solver.intra_op import evaluate, solve_intra_op
from autopar.solver.memory_floor import memory_floor
from examples import factories
from tests.unit.test_axis_descent import two_axis_problem


def _both(monkeypatch, fn):
    """fn() with the shortcuts on, then off."""
    monkeypatch.setattr(search_memo, "ENABLED", True)
    on = fn()
    monkeypatch.setattr(search_memo, "ENABLED", False)
    off = fn()
    return on, off


def test_allowed_mask_is_isin():
    for k, allowed in [(5, [0, 3]), (4, []), (3, [2, 2, 1]), (4, [-1, 1]), (3, [7]), (6, range(6))]:
        assert np.array_equal(allowed_mask(k, allowed), np.isin(np.arange(k), list(allowed)))


def test_axis_keys_shared_equal_the_plain_loop(monkeypatch):
    """On a small GPT's candidates on a (2, 2) mesh, where repeated layers share Strategy objects."""
    model, inputs, loss, target = factories.gpt(hidden=32, layers=3, heads=2, seq=16, batch=4, vocab=64)
    traced = trace(model, inputs, loss, target)
    strategies = list(build_candidates(traced.gm, (2, 2)).strategies.values())
    on, off = _both(monkeypatch, lambda: axis_keys(strategies))
    assert len(on) == len(off) == len(strategies)
    assert sum(a is b for a, b in zip(on, on[1:])) or len({id(a) for a in on}) < len(on), "nothing was shared"
    for a, b in zip(on, off):
        assert a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.parametrize("seed", range(4))
def test_floor_evaluate_and_solves_equal_the_plain_code(seed, monkeypatch):
    """Random two-axis problems with shared edge tables, allowed lists and forbidden entries: the memory
    floor, ``evaluate`` (also of a forbidden pick), the descent and the solve are the same floats and picks."""
    rng = np.random.default_rng(seed)
    p = two_axis_problem(rng, n=10, budget_share=0.4, ties=True)
    shared = p.edges[0].cost
    p.edges = [dataclasses.replace(e, cost=shared, memory=np.full(shared.shape, 5.0) if i % 2 else None)
               for i, e in enumerate(p.edges)]
    p.nodes[3] = dataclasses.replace(p.nodes[3], allowed=[0, 2, 4, 8])
    p.nodes[5].compute[1] = np.inf
    hi = sum(float(n.memory.max()) for n in p.nodes) + 5.0 * len(p.edges)
    p.memory_budget = memory_floor(p) + 0.3 * (hi - memory_floor(p))
    p.hint = None
    pick = list(rng.integers(0, 9, len(p.nodes)))
    forbidden = list(pick)
    forbidden[5] = 1
    on, off = _both(monkeypatch, lambda: (memory_floor(p), evaluate(p, pick), evaluate(p, forbidden),
                                          descend(p, solve_intra_op, pick, 1e18), solve_intra_op(p)))
    assert on[:3] == off[:3] and on[2][0] == float("inf")
    assert on[3] == off[3]
    assert (on[4].choice, on[4].objective, on[4].memory, on[4].status) == \
        (off[4].choice, off[4].objective, off[4].memory, off[4].status)


def _plan(monkeypatch, enabled: bool, job, mesh) -> dict:
    monkeypatch.setattr(search_memo, "ENABLED", enabled)
    model, inputs, loss, target = job()
    autopar.set_auto_parallel_context(solver_time_limit=60.0)    # no solve ends at its wall-time limit
    try:
        plan = autopar.plan(model, mesh, example_inputs=inputs, loss_fn=loss, example_target=target, mode="auto")
    finally:
        autopar.reset_auto_parallel_context()
    d = plan.to_dict()
    d.pop("solve_time")
    return d


def test_auto_plans_the_same_with_the_descent_on_every_solve(monkeypatch):
    """A 2-layer GPT on 4 H100s (2 per node), the descent forced on every multi-axis solve
    (``DESCENT_PAIRS`` 0, as Llama-3 8B's solves on 64 devices run it): AUTO reaches the pipeline search and
    returns the same plan, field for field (degrees, microbatches, schedule, every node's strategy and
    options, predicted step and memory, the alternatives), with the shortcuts on and off."""
    monkeypatch.setattr(axis_descent, "DESCENT_PAIRS", 0)
    monkeypatch.setattr(axis_descent, "free_first", lambda p: (None, None))    # every such solve descends
    calls = []
    real = axis_descent.descend
    monkeypatch.setattr(axis_descent, "descend", lambda *a, **k: calls.append(1) or real(*a, **k))
    job = lambda: factories.gpt(hidden=32, layers=2, heads=2, seq=32, batch=8, vocab=256)  # noqa: E731
    mesh = autopar.Mesh(4, device="h100", gpus_per_node=2)
    on = _plan(monkeypatch, True, job, mesh)
    assert calls, "no solve ran the descent: the test compares nothing"
    off = _plan(monkeypatch, False, job, mesh)
    for key in on:
        assert on[key] == off[key], key
    assert any("pp=" in a["note"] for a in on["alternatives"]), "no pipeline candidate was solved"


def test_auto_plans_the_same_with_the_free_optimum_decided_first(monkeypatch):
    """The same job and descent: where the unbudgeted optimum fits or cannot beat the best plan,
    ``axis_descent.free_first`` decides before the descent; the plan is the same, field for field
    (the alternatives' dominated meshes included), as with every such solve descending first."""
    monkeypatch.setattr(axis_descent, "DESCENT_PAIRS", 0)
    decided = []
    real = axis_descent.free_first
    monkeypatch.setattr(axis_descent, "free_first", lambda p: (r := real(p))[0] is not None and
                        decided.append(1) or r)
    job = lambda: factories.gpt(hidden=32, layers=2, heads=2, seq=32, batch=8, vocab=256)  # noqa: E731
    mesh = autopar.Mesh(4, device="h100", gpus_per_node=2)
    first = _plan(monkeypatch, True, job, mesh)
    assert decided, "no solve was decided by the free optimum: the test compares nothing"
    monkeypatch.setattr(axis_descent, "free_first", lambda p: (None, None))
    assert _plan(monkeypatch, True, job, mesh) == first


@pytest.mark.slow
@pytest.mark.parametrize("job,mesh", [
    (lambda: factories.gpt(hidden=64, layers=4, heads=4, seq=64, batch=16, vocab=2048), (8, 4)),
    (lambda: factories.gpt(hidden=128, layers=4, heads=4, seq=64, batch=16, vocab=4096), (16, 8)),
], ids=["gpt4-on-8", "gpt4-on-16"])
def test_auto_plans_the_same_with_the_descent_on_bigger_jobs(job, mesh, monkeypatch):
    monkeypatch.setattr(axis_descent, "DESCENT_PAIRS", 0)
    monkeypatch.setattr(axis_descent, "free_first", lambda p: (None, None))
    m = autopar.Mesh(mesh[0], device="h100", gpus_per_node=mesh[1])
    on, off = _plan(monkeypatch, True, job, m), _plan(monkeypatch, False, job, m)
    assert on == off
    assert any("pp=" in a["note"] for a in on["alternatives"])


@pytest.mark.slow
def test_llama_plans_the_same_with_the_descent_on(monkeypatch):
    """An HF Llama with grouped-query attention (2 key/value heads) on 8 H100s, 4 per node."""
    from tests.unit.test_search_memo import _hf_llama

    monkeypatch.setattr(axis_descent, "DESCENT_PAIRS", 0)
    m = autopar.Mesh(8, device="h100", gpus_per_node=4)
    on, off = _plan(monkeypatch, True, _hf_llama, m), _plan(monkeypatch, False, _hf_llama, m)
    assert on == off
    assert any("pp=" in a["note"] for a in on["alternatives"])


def test_map_edges_shares_picks_only_as_values(monkeypatch):
    """Two parallel edges between the same tied classes with one table: the class edge is their sum,
    with the shortcut as without (the picked table is not mutated by the first addition)."""
    rng = np.random.default_rng(7)
    p = two_axis_problem(rng, n=6)
    p.ties = [[0, 2], [1, 3]]
    table = p.edges[0].cost
    p.edges = [intra_op.EdgeCost(0, 1, table), intra_op.EdgeCost(2, 3, table), intra_op.EdgeCost(4, 5, table)]

    def graph():
        g, class_of = intra_op._collapse_ties(p)
        intra_op._map_edges(p, g, class_of)
        return {k: v.copy() for k, v in g.edges.items()}
    on, off = _both(monkeypatch, graph)
    assert on.keys() == off.keys() and all(np.array_equal(on[k], off[k]) for k in on)
    assert np.array_equal(table, p.edges[0].cost)
