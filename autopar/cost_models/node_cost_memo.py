"""``compute.node_cost`` once per (traced graph, device): the planning search prices one graph on many
meshes and sub-meshes with the same device (every stage-cut candidate's unit costs, every solve's node
prices), and ``node_cost`` is a pure function of the node (its graph) and the device. Kept in the graph
module's ``meta``; under ``core.search_memo`` off, a fresh table per call (the plain computation)."""
from __future__ import annotations

import torch.fx as fx

from autopar.core import search_memo
from autopar.cost_models.compute import OpCost, node_cost


def node_cost_table(graph: fx.Graph, device) -> dict:
    """The table ``cached_node_cost`` fills for nodes of ``graph`` on ``device`` (one per graph and device
    repr, while the graph keeps its node count)."""
    gm = graph.owning_module
    if not search_memo.ENABLED or gm is None or not hasattr(gm, "meta"):
        return {}
    return search_memo.graph_cache(gm, "node_cost").setdefault(repr(device), {})


def cached_node_cost(table: dict, node: fx.Node, device) -> OpCost:
    """``node_cost(node, device)`` through ``table`` (``node_cost_table`` of the node's graph and ``device``)."""
    hit = table.get(node.name)
    if hit is None or hit[0] is not node:
        hit = table[node.name] = (node, node_cost(node, device))
    return hit[1]
