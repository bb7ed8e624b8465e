"""Split one rank's training graph into one GraphModule per pipeline stage.

Input: the per-rank graph (after ``insert_collectives`` / ``localize_shapes``) and the Plan's
stages (original node names per stage). Nodes the passes inserted get a stage from their users:

    stage(v) = min over users u of stage(u)   (the graph output counts as the last stage)
    stage(getitem(x, i)) = stage(x)

so a collective inserted before its consumer runs with the consumer. An inserted node whose
users run on several stages (one gather of a tied weight shared by the embedding and the
head) is copied per stage. So only planned values cross a cut, each in its producer's
placement (peer ranks of two stages share their (dp, tp) coordinates, so each sends its local
piece to its peer: no resharding at the cut).

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

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.plan_specs import PlanSpecs
from autopar.sharding.placements import local_shape


class SplitError(ValueError):
    """The stage assignment is not a valid pipeline (a value would flow to an earlier stage)."""


@dataclass(frozen=True)
class Transfer:
    index: int
    value: str            # node name in the full per-rank graph
    src: int              # producing stage
    dst: int              # consuming stage
    shape: tuple          # local shape on every rank
    dtype: torch.dtype

    @property
    def floating(self) -> bool:
        return self.dtype.is_floating_point

    def tag(self, microbatch: int, backward: bool, total: int) -> int:
        return self.index + total * (2 * microbatch + int(backward))


@dataclass
class StageGraph:
    stage: int
    gm: fx.GraphModule
    placeholders: list[str]                               # original placeholders, in gm input order
    recvs: list[Transfer] = field(default_factory=list)   # then these, in gm input order
    sends: list[Transfer] = field(default_factory=list)
    send_index: dict[str, int] = field(default_factory=dict)   # value name -> gm output index
    results: dict[int, int] = field(default_factory=dict)      # original output index -> gm output index


def assign_stages(gm: fx.GraphModule, stage_of: dict[str, int], num_stages: int) -> dict[str, int]:
    """Stage of every call node of ``gm`` (module docstring); raises SplitError on a backward edge.

    A node the passes inserted whose users run on several stages is copied once per stage, so
    each stage redoes it (e.g. gathers its own copy of a tied weight) and only planned values
    cross cuts, in the placement the plan gives them. ``gm`` is changed in place."""
    last = num_stages - 1
    out = dict(stage_of)
    graph = gm.graph
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node.name in out:
            continue
        by_stage: dict[int, list[fx.Node]] = {}
        for u in node.users:
            by_stage.setdefault(last if u.op == "output" else out.get(u.name, last), []).append(u)
        first = min(by_stage, default=last)
        out[node.name] = first
        if node.target is operator.getitem:
            continue
        for s, users in sorted(by_stage.items())[1:]:
            with graph.inserting_after(node):
                copy = graph.node_copy(node)
            copy.meta = dict(node.meta)
            for u in users:
                u.replace_input_with(node, copy)
            out[copy.name] = s
    for node in graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            out[node.name] = out[node.args[0].name]
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        for a in node.all_input_nodes:
            if a.op == "call_function" and out[a.name] > out[node.name]:
                raise SplitError(f"{node.name} (stage {out[node.name]}) uses {a.name} from the later stage "
                                 f"{out[a.name]}; stage cuts must follow the graph order")
    return out


def _local_val(node: fx.Node, specs: PlanSpecs, mesh_shape) -> tuple[tuple, torch.dtype]:
    val = node.meta.get("val")
    if node.target is operator.getitem:
        spec = specs.spec(node.args[0], node.args[1])
    elif node.name in specs.plan.nodes:
        spec = specs.spec(node)
    else:
        raise SplitError(f"{node.name!r} crosses a stage cut but has no placement in the plan; only planned "
                         "values may cross cuts (make a new plan)")
    if not isinstance(val, torch.Tensor):
        raise SplitError(f"cannot tell the local shape of {node.name!r}, which crosses a stage cut")
    return local_shape(tuple(val.shape), spec, mesh_shape), val.dtype


def split_stages(gm: fx.GraphModule, stage_of: dict[str, int], num_stages: int, plan, mesh_shape
                 ) -> tuple[list[StageGraph], list[Transfer]]:
    """One StageGraph per stage and every transfer between stages (module docstring)."""
    stages = assign_stages(gm, stage_of, num_stages)
    last = num_stages - 1
    specs = PlanSpecs(plan, len(mesh_shape))
    output = next(n for n in gm.graph.nodes if n.op == "output")
    transfers: list[Transfer] = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or isinstance(node.meta.get("val"), (tuple, list)):
            continue
        dsts = sorted({last if u.op == "output" else stages[u.name] for u in node.users} - {stages[node.name]})
        for dst in dsts:
            shape, dtype = _local_val(node, specs, mesh_shape)
            transfers.append(Transfer(len(transfers), node.name, stages[node.name], dst, shape, dtype))
    graphs = [_stage_graph(gm, s, stages, transfers, output, s == last) for s in range(num_stages)]
    return graphs, transfers


def _stage_graph(gm: fx.GraphModule, s: int, stages: dict, transfers: list[Transfer], output: fx.Node,
                 is_last: bool) -> StageGraph:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    mine = [n for n in gm.graph.nodes if n.op == "call_function" and stages[n.name] == s]
    used = {a for n in mine for a in n.all_input_nodes if a.op == "placeholder"}
    if is_last:
        used |= {a for a in output.all_input_nodes if a.op == "placeholder"}
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
