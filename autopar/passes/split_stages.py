"""Split one rank's training graph into one GraphModule per pipeline stage.

Input: the per-rank graph (after ``insert_collectives`` / ``localize_shapes``) and the Plan's
stages (original node names per stage). Nodes the passes inserted get a stage from their users:

    stage(v) = min over users u of stage(u)   (the graph output counts as the last stage)
    stage(getitem(x, i)) = stage(x)

so a collective inserted before its consumer runs with the consumer. An inserted node whose
users run on several stages (one gather of a tied weight shared by the embedding and the
head) is copied per stage. So only planned values cross a cut, each in its producer's
placement (peer ranks of two stages share their (dp, tp) coordinates, so each sends its local
piece to its peer: no resharding at the cut). The stage rule, the transfers and each stage's
placeholders are ``plan/stage_cuts.py``'s: the solver lists the same transfers as the plan's
sends and receives (``plan.collectives``).

A stage graph keeps the graph-module attributes (``get_attr`` nodes) its nodes read, like the
placeholders it uses: torch.export turns a ``torch.no_grad()`` region (Hugging Face rotary
embeddings) into ``wrap_with_set_grad_enabled(False, submod, ...)``, whose body is such an attribute.

Each stage graph takes ``(*placeholders it uses, *received values)`` and returns
``(*values it sends, *graph outputs)`` (outputs on the last stage only). A ``Transfer`` names
one (value, source stage, destination stage) with the value's local shape and dtype; its
``tag`` keeps p2p messages apart: ``tag(t, microbatch, phase) = t + T * (2 * microbatch + phase)``
with ``T`` transfers and phase 0 for activations, 1 for their gradients.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from autopar.plan.stage_cuts import (SplitError, Transfer, assign_stages, stage_placeholders,  # noqa: F401
                                      stage_transfers)
from autopar.plan.specs import PlanSpecs


@dataclass
class StageGraph:
    stage: int
    gm: fx.GraphModule
    placeholders: list[str]                               # original placeholders, in gm input order
    recvs: list[Transfer] = field(default_factory=list)   # then these, in gm input order
    sends: list[Transfer] = field(default_factory=list)
    send_index: dict[str, int] = field(default_factory=dict)   # value name -> gm output index
    results: dict[int, int] = field(default_factory=dict)      # original output index -> gm output index


def split_stages(gm: fx.GraphModule, stage_of: dict[str, int], num_stages: int, plan, mesh_shape
                 ) -> tuple[list[StageGraph], list[Transfer]]:
    """One StageGraph per stage and every transfer between stages (module docstring)."""
    stages = assign_stages(gm, stage_of, num_stages)
    last = num_stages - 1
    transfers = stage_transfers(gm, stages, num_stages, PlanSpecs(plan, len(mesh_shape)), mesh_shape)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    graphs = [_stage_graph(gm, s, stages, transfers, output, s == last) for s in range(num_stages)]
    return graphs, transfers


def _stage_graph(gm: fx.GraphModule, s: int, stages: dict, transfers: list[Transfer], output: fx.Node,
                 is_last: bool) -> StageGraph:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    mine = [n for n in gm.graph.nodes if n.op == "call_function" and stages[n.name] == s]
    used = stage_placeholders(gm, stages, s, is_last)
    by_name = {n.name: n for n in gm.graph.nodes}
    placeholders = []
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node in used:
            env[node] = g.placeholder(node.name)
            env[node].meta = dict(node.meta)
            placeholders.append(node.name)
    attrs = {a for n in mine for a in n.all_input_nodes if a.op == "get_attr"}
    for node in gm.graph.nodes:
        if node in attrs:
            env[node] = g.node_copy(node)
    recvs = [t for t in transfers if t.dst == s]
    for t in recvs:
        src = by_name[t.value]
        env[src] = g.placeholder(t.value)
        env[src].meta = dict(src.meta)
    for node in mine:
        env[node] = g.node_copy(node, lambda a: env[a])
    sends = [t for t in transfers if t.src == s]
    send_index: dict[str, int] = {}
    outs = []
    for t in sends:
        if t.value not in send_index:
            send_index[t.value] = len(outs)
            outs.append(env[by_name[t.value]])
    results = {}
    if is_last:
        for i, a in enumerate(output.args[0]):
            results[i] = len(outs)
            outs.append(env[a] if isinstance(a, fx.Node) else a)
    g.output(tuple(outs))
    sgm = fx.GraphModule(gm, g)
    return StageGraph(s, sgm, placeholders, recvs, sends, send_index, results)


def forward_only(stage: StageGraph, keep_results: list[int]) -> fx.GraphModule:
    """The stage graph computing only its sends and the named graph outputs (inference)."""
    g = fx.Graph()
    old = g.graph_copy(stage.gm.graph, {})
    keep = [old[i] for i in range(len(stage.send_index))] + [old[stage.results[r]] for r in keep_results]
    g.output(tuple(keep))
    g.eliminate_dead_code()
    return fx.GraphModule(stage.gm, g)
