import math

import pytest

from autopar.cost_models.comm import (
    COLLECTIVE_KINDS,
    CommCost,
    axis_collective_time,
    collective_cost,
    collective_time,
    hierarchical_all_reduce_time,
)
from autopar.cost_models.devices import Link, get_device

LINK = Link(bandwidth=100e9, latency=10e-6)
N = 1e9  # bytes


def test_ring_formulas_by_hand():
    # all_reduce p=4: 2*3/4 * 1e9/1e11 + 2*3*1e-5 = 0.015 + 6e-5
    assert collective_time("all_reduce", N, 4, LINK) == pytest.approx(0.015 + 6e-5)
    # all_gather / reduce_scatter p=8: 7/8 * 0.01 + 7e-5
    assert collective_time("all_gather", N, 8, LINK) == pytest.approx(0.00875 + 7e-5)
    assert collective_time("reduce_scatter", N, 8, LINK) == pytest.approx(0.00875 + 7e-5)
    assert collective_time("all_to_all", N, 2, LINK) == pytest.approx(0.005 + 1e-5)
    # broadcast p=5: ceil(log2 5) = 3 hops of (0.01 + 1e-5)
    assert collective_time("broadcast", N, 5, LINK) == pytest.approx(3 * (0.01 + 1e-5))
    assert collective_time("send_recv", N, 2, LINK) == pytest.approx(0.01 + 1e-5)


def test_all_reduce_is_reduce_scatter_plus_all_gather():
    for p in (2, 3, 8, 64):
        ar = collective_time("all_reduce", N, p, LINK)
        rs_ag = collective_time("reduce_scatter", N, p, LINK) + collective_time("all_gather", N, p, LINK)
        assert ar == pytest.approx(rs_ag)


@pytest.mark.parametrize("kind", COLLECTIVE_KINDS)
def test_group_of_one_is_free(kind):
    assert collective_time(kind, N, 1, LINK) == 0.0
    assert collective_time(kind, 0, 8, LINK) == 0.0


def test_unknown_kind_lists_kinds():
    with pytest.raises(ValueError) as err:
        collective_time("allreduce", N, 2, LINK)
    for kind in COLLECTIVE_KINDS:
        assert kind in str(err.value)


def test_comm_cost_dataclass():
    cost = collective_cost("all_reduce", N, 4, LINK)
    assert isinstance(cost, CommCost)
    assert cost == CommCost("all_reduce", N, 4, collective_time("all_reduce", N, 4, LINK))
    with pytest.raises(Exception):
        cost.time = 0.0


def test_axis_inside_a_node_uses_nvlink():
    dev = get_device("a100-80gb")
    assert axis_collective_time("all_gather", N, dev, 8, 1) == collective_time("all_gather", N, 8, dev.intra_node_link)


def test_axis_across_nodes_uses_the_network_and_hierarchy():
    dev = get_device("a100-80gb")
    flat = collective_time("all_reduce", N, 16, dev.inter_node_link)
    hier = hierarchical_all_reduce_time(N, 8, 2, dev)
    # reduce_scatter + all_gather inside the node, all_reduce of N/8 across 2 nodes
    by_hand = 2 * (7 / 8 * N / 300e9 + 7 * 5e-6) + (N / 8) / 25e9 + 2 * 1e-5
    assert hier == pytest.approx(by_hand)
    assert axis_collective_time("all_reduce", N, dev, 16, 1) == pytest.approx(min(flat, hier))
    assert hier < flat
    # a dp axis of 2 with 8 devices inside each group: one device per node, flat ring
    assert axis_collective_time("all_reduce", N, dev, 2, 8) == pytest.approx(
        collective_time("all_reduce", N, 2, dev.inter_node_link)
    )
    assert math.isfinite(axis_collective_time("all_to_all", N, dev, 16, 1))
