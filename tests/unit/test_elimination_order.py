"""The elimination order (``elimination.elimination_order``): the rule of ``ORDERS`` doing the fewest
sums is run, and every rule gives brute force's optimum."""
import math

import numpy as np
import pytest

from autopar.solver import elimination
from tests.unit.test_solver_intra_op import _dense_graph

# a transformer layer's core as Llama-3 8B's search leaves it (class -> candidates; its factor pairs)
CORE_SIZES = {61: 14, 64: 35, 67: 35, 71: 13, 72: 13, 73: 48, 78: 48, 79: 35, 80: 48, 85: 48, 86: 35, 94: 63}
CORE_EDGES = [(64, 73), (71, 73), (72, 78), (73, 79), (78, 79), (67, 80), (71, 80), (72, 85), (80, 86), (85, 86),
              (79, 94), (71, 72), (61, 64), (61, 67), (64, 78), (67, 85), (86, 94), (61, 94)]


def _neighbours(sizes, edges):
    nbrs = {a: set() for a in sizes}
    for a, b in edges:
        nbrs[a].add(b)
        nbrs[b].add(a)
    return nbrs


def test_the_order_of_fewest_sums_is_run_on_a_layer_core():
    nbrs = _neighbours(CORE_SIZES, CORE_EDGES)
    totals = {key.__name__: elimination._order(nbrs, CORE_SIZES, key)[1] for key in elimination.ORDERS}
    chosen = sum(e for _, _, e in elimination.elimination_order(nbrs, CORE_SIZES))
    assert chosen == min(totals.values())
    assert totals["_by_sums"] > 10 * totals["_by_table"]     # the case discriminates: 1.5e8 vs 1.1e7 sums
    assert nbrs == _neighbours(CORE_SIZES, CORE_EDGES)       # the simulation leaves its input as it was


@pytest.mark.parametrize("seed", range(12))
def test_every_order_gives_the_optimum(seed, monkeypatch):
    rng = np.random.default_rng(500 + seed)
    g, best = _dense_graph(rng, int(rng.integers(3, 8)))
    for key in elimination.ORDERS:
        monkeypatch.setattr(elimination, "ORDERS", (key,))
        value, picked = elimination.eliminate_best(g, sorted(g.alive))
        if math.isinf(best):
            assert math.isinf(value)
            continue
        assert value == pytest.approx(best, abs=1e-9)
        score = sum(g.compute[a][picked[a]] for a in sorted(g.alive)) + \
            sum(m[picked[a], picked[b]] for (a, b), m in g.edges.items())
        assert score == pytest.approx(best, abs=1e-9)


def test_an_order_over_the_limits_is_not_chosen_for_its_fewer_sums(monkeypatch):
    """Of two orders, the one of fewer sums with a step over ``limit`` loses to one within it (else the
    problem would go to CP-SAT although an order exists that eliminates it)."""
    sizes = {0: 10, 1: 2, 2: 3}
    few = ([(0, (1, 2), 60), (1, (2,), 6), (2, (), 3)], 69)         # one step of 60 sums
    many = ([(1, (0,), 20), (2, (0,), 30), (0, (), 10)], 60 + 25)    # every step within 30
    fake = {elimination._by_sums: few, elimination._by_table: many}
    monkeypatch.setattr(elimination, "_order", lambda nbrs, sz, key: fake[key])
    assert elimination.elimination_order({}, sizes, limit=1000) == few[0]
    assert elimination.elimination_order({}, sizes, limit=40) == many[0]
    assert elimination.elimination_order({}, sizes, limit=5) == few[0]    # none within: the first order
