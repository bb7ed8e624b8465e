"""What crosses a pipeline's stage cuts: the one source of the point-to-point transfers.

Both sides read it: ``passes/split_stages.py`` cuts a rank's graph into stage graphs with it
(the runtime sends exactly these ``Transfer``s), and the solver lists the same transfers in the
plan's collectives (``solver/pipeline_search.py``), from the plan's microbatch graph.

    stage(v) = stage_of[v] for an op the plan places; a node the passes inserted takes
               min over users u of stage(u)   (the graph output counts as the last stage)
    stage(getitem(x, i)) = stage(x)
    transfers: one per (value v, stage d) with d != stage(v) a stage of a user of v, in graph
               order, each with v's local shape (its producer's placement) and dtype
    placeholders of stage s: those its nodes read (the last stage: also those the output returns)

On the plan's own graph every op has a stage (``graph.cut_points.assign_units`` covers every
call), so nothing is inserted or copied there and the transfers are the planned values whose
users run on a later stage; on a rank's graph the inserted collectives run with their consumers,
so the same planned values cross the same cuts.

``specs`` is anything with ``spec(node, index=None)`` and ``has(node)`` (``plan_specs.PlanSpecs``).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

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
        """Whether its gradient travels back (dst -> src) in backward."""
        return self.dtype.is_floating_point

    @property
    def nbytes(self) -> int:
        """Bytes of one message (the activation, or its gradient)."""
        n = 1
        for d in self.shape:
            n *= int(d)
        return n * torch.empty((), dtype=self.dtype).element_size()

    def tag(self, microbatch: int, backward: bool, total: int) -> int:
        return self.index + total * (2 * microbatch + int(backward))


def assign_stages(gm: fx.GraphModule, stage_of: dict[str, int], num_stages: int) -> dict[str, int]:
    """Stage of every call node of ``gm`` (module docstring); raises SplitError on a backward edge.

    A node the passes inserted whose users run on several stages is copied once per stage, so
    each stage redoes it (e.g. gathers its own copy of a tied weight) and only planned values
    cross cuts, in the placement the plan gives them. ``gm`` is changed in place (only when
    ``stage_of`` leaves out such a node)."""
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


def _local_val(node: fx.Node, specs, mesh_shape) -> tuple[tuple, torch.dtype]:
    val = node.meta.get("val")
    if node.target is operator.getitem:
        spec = specs.spec(node.args[0], node.args[1])
    elif specs.has(node):
        spec = specs.spec(node)
    else:
        raise SplitError(f"{node.name!r} crosses a stage cut but has no placement in the plan; only planned "
                         "values may cross cuts (make a new plan)")
    if not isinstance(val, torch.Tensor):
        raise SplitError(f"cannot tell the local shape of {node.name!r}, which crosses a stage cut")
    return local_shape(tuple(val.shape), spec, mesh_shape), val.dtype


def stage_transfers(gm: fx.GraphModule, stages: dict[str, int], num_stages: int, specs, mesh_shape
                    ) -> list[Transfer]:
    """Every transfer between stages, in graph order (``stages`` from ``assign_stages``)."""
    last = num_stages - 1
    transfers: list[Transfer] = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or isinstance(node.meta.get("val"), (tuple, list)):
            continue
        dsts = sorted({last if u.op == "output" else stages[u.name] for u in node.users} - {stages[node.name]})
        for dst in dsts:
            shape, dtype = _local_val(node, specs, mesh_shape)
            transfers.append(Transfer(len(transfers), node.name, stages[node.name], dst, shape, dtype))
    return transfers


def stage_placeholders(gm: fx.GraphModule, stages: dict[str, int], stage: int, is_last: bool) -> set[fx.Node]:
    """The placeholders stage ``stage``'s graph takes (the last stage: also those the output returns)."""
    used = {a for n in gm.graph.nodes if n.op == "call_function" and stages[n.name] == stage
            for a in n.all_input_nodes if a.op == "placeholder"}
    if is_last:
        output = next(n for n in gm.graph.nodes if n.op == "output")
        used |= {a for a in output.all_input_nodes if a.op == "placeholder"}
    return used
