"""Building the intra-op problem: repeated layers are costed once, and that changes nothing."""
import numpy as np
import pytest
import torch

from autopar.graph.grads import grad_nodes
from autopar.cost_models.devices import get_device
from autopar.cost_models.memory import saved_bytes_by_node
from autopar.sharding.candidates import build_candidates
from autopar.sharding.rules import axis_options, has_rule
from autopar.sharding.strategy import _combinations, out_shapes, replicate_all, shape_of, tensor_inputs
from autopar.solver.problem import build_problem
from autopar.solver.strategy_prices import Costing, cost_key, node_costs
from autopar.frontend.trace import trace
from examples.models import GPT, lm_loss
from oracle import make_batch

MESH = (2, 2)


def _traced():
    torch.manual_seed(0)
    x, y = make_batch("tokens", 4, vocab=64, seq=8)
    return trace(GPT(vocab=64, hidden=32, heads=2, layers=3, seq=8, qkv_bias=False), (x,), lm_loss, y)


def test_memoised_node_costs_equal_costing_every_node():
    tr = _traced()
    cands = build_candidates(tr.gm, MESH)
    costing = Costing(MESH, get_device("a100-80gb"), "adamw", "fp32", frozen_buffers=set(tr.buffers))
    built = build_problem(tr.gm, cands, costing, set(tr.params))
    saved = saved_bytes_by_node(tr.gm, dropout_mask_bytes=1)
    by_name = {n.name: n for n in tr.gm.graph.nodes}
    need = grad_nodes(tr.gm.graph)
    keys = set()
    for i, name in enumerate(built.names):
        comp, mem, _ = node_costs(by_name[name], cands.strategies[name], costing, saved, set(tr.params))
        assert np.array_equal(built.problem.nodes[i].compute, comp), name
        assert np.array_equal(built.problem.nodes[i].memory, mem), name
        keys.add(cost_key(by_name[name], cands.strategies[name], saved, set(tr.params), need))
    assert len(keys) < 0.6 * len(built.names), "3 equal blocks should share most of their costings"


def test_memoised_strategies_equal_enumerating_every_node():
    tr = _traced()
    cands = build_candidates(tr.gm, MESH)
    checked = 0
    for node in tr.gm.graph.nodes:
        if node.name not in cands.strategies or node.op != "call_function":
            continue

        def combos(options, node=node):
            return _combinations(node, replicate_all(node), options, MESH, [shape_of(a) for a in tensor_inputs(node)],
                                 out_shapes(node), 64)

        fresh = combos(axis_options(node) if has_rule(node.target) else []) or combos([replicate_all(node)])
        assert cands.strategies[node.name] == fresh, node.name
        checked += 1
    assert checked > 50


@pytest.mark.parametrize("zero, microbatches, recompute", [(0, 1, "none"), (0, 4, "none"), (0, 4, "selective"),
                                                           (1, 4, "full"), (3, 2, "none")])
def test_op_transients_never_exceed_the_transients_of_any_assignment(zero, microbatches, recompute):
    """The solver keeps room for ``op_transients`` (its largest max term plus its sum terms) beside
    the memory row; they must be lower bounds of ``transient_bytes``, which the total adds after the
    solve, for every assignment, else the first solve would refuse layouts that fit."""
    from autopar.solver.memory_terms import op_transients, transient_bytes

    tr = _traced()
    cands = build_candidates(tr.gm, MESH)
    costing = Costing(MESH, get_device("a100-80gb"), "adamw", "fp32", frozen_buffers=set(tr.buffers), zero=zero,
                      microbatches=microbatches, recompute=recompute)
    built = build_problem(tr.gm, cands, costing, set(tr.params))
    peak, added = op_transients(tr.gm, cands, built, costing, tr.params)
    assert any(t is not None for t in peak) and (any(a is not None for a in added) == (zero == 0 and microbatches > 1))
    rng = np.random.default_rng(0)
    for _ in range(20):
        choice = [int(rng.integers(len(n.compute))) for n in built.problem.nodes]
        bound = (max(float(t[s]) for t, s in zip(peak, choice) if t is not None)
                 + sum(float(a[s]) for a, s in zip(added, choice) if a is not None))
        assert 0 < bound <= transient_bytes(tr.gm, cands, built, choice, costing, tr.params) * (1 + 1e-12)


def test_op_transients_of_repeated_layers_equal_each_node_costed_alone():
    """``op_transients`` costs one array per (node kind, gradient sizes and aliasing) and gives it to
    every repeated layer's node (GPT-2 XL's 20 pipeline candidates: 417 588 strategy evaluations, ~7 %
    of its search): every node's array equals its own strategies costed one by one."""
    from autopar.solver.memory_terms import _op_gradients, op_gradient_facts, op_transients

    tr = _traced()
    cands = build_candidates(tr.gm, MESH)
    costing = Costing(MESH, get_device("a100-80gb"), "adamw", "fp32", frozen_buffers=set(tr.buffers))
    built = build_problem(tr.gm, cands, costing, set(tr.params))
    peak, _ = op_transients(tr.gm, cands, built, costing, tr.params)
    facts = op_gradient_facts(tr.gm, tr.params, costing)
    shared = 0
    for name, terms in zip(built.names, peak):
        if name not in facts:
            assert terms is None
            continue
        alone = [sum(live.values()) + own for live, own in
                 (_op_gradients(facts[name], st, costing) for st in cands.strategies[name])]
        np.testing.assert_array_equal(terms, alone)
        shared += sum(t is terms for t in peak) > 1
    assert shared > 10          # the layers' nodes do share their arrays


def test_edges_of_repeated_layers_equal_each_edge_costed_alone():
    """``_edges_of`` gives repeated layers' edges one table per (kinds, positions, bytes): every edge's
    resharding table and gathered-copy bytes (parameters', and saved activations' from
    ``seq_parallel.with_gathered_copies``) equal those of the edge costed alone."""
    from autopar.cost_models.memory import saves_input
    from autopar.solver.problem import graph_edges as _graph_edges
    from autopar.solver.strategy_prices import edge_cost as _edge, gathered_matrix as _gathered_matrix
    from autopar.solver.seq_parallel import gathered_copy_table, saving_consumers
    from autopar.solver.strategy_prices import tensor_bytes

    tr = _traced()
    cands = build_candidates(tr.gm, MESH)
    costing = Costing(MESH, get_device("a100-80gb"), "adamw", "fp32", frozen_buffers=set(tr.buffers))
    built = build_problem(tr.gm, cands, costing, set(tr.params))
    by_name = {n.name: n for n in tr.gm.graph.nodes}
    need = grad_nodes(tr.gm.graph)
    fresh = Costing(MESH, get_device("a100-80gb"), "adamw", "fp32", frozen_buffers=set(tr.buffers))
    pairs = list(_graph_edges(built.names, by_name, built.index))
    assert len(pairs) == len(built.problem.edges) > 100
    shared = 0
    for e, (n, node, i, a, src, idx) in zip(built.problem.edges, pairs):
        alone = _edge(src, idx, node, i, cands, built.index, fresh)
        assert (e.src, e.dst) == (alone.src, alone.dst)
        np.testing.assert_array_equal(e.cost, alone.cost)
        kept = None
        if src.name in tr.params and node in need and saves_input(node, a, 1):
            kept = _gathered_matrix(a, cands.strategies[src.name], cands.strategies[n], i, fresh)
            kept = kept if kept.any() else None
        elif node in need and saves_input(node, a, 1):      # an activation a consumer keeps gathered (SP)
            kept = gathered_copy_table(tuple(st.output if idx is None else st.output[idx]
                                             for st in cands.strategies[src.name]),
                                       tuple(st.inputs[i] for st in cands.strategies[n]),
                                       tensor_bytes(src, idx), saving_consumers(a, 1), fresh)
        assert (e.memory is None) == (kept is None)
        if kept is not None:
            np.testing.assert_array_equal(e.memory, kept)
        shared += sum(f.cost is e.cost for f in built.problem.edges) > 1
    assert shared > 10
