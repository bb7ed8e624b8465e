"""Read the placements a Plan gives every value of the graph."""
from __future__ import annotations

import operator

import torch.fx as fx

from autopar.plan.plan import PlanError
from autopar.sharding.placements import replicated


class PlanSpecs:
    """``spec(node)``: the placement of a node's output under the plan."""

    def __init__(self, plan, mesh_ndim: int):
        self.plan = plan
        self.k = mesh_ndim
        self.by_placeholder = {p.placeholder: p.spec for p in plan.params.values()}
        self.by_placeholder.update(plan.inputs)
        self._same_as: dict[str, fx.Node] = {}

    def same_as(self, new: fx.Node, old: fx.Node) -> None:
        """``new`` (a node a pass inserted after ``old``, e.g. a local rescale) has ``old``'s placement."""
        self._same_as[new.name] = old

    def has(self, node: fx.Node) -> bool:
        """Whether the plan decides ``node``'s strategy (an op it places)."""
        return node.name in self.plan.nodes

    def spec(self, node: fx.Node, index: int | None = None):
        if node.name in self._same_as:
            return self.spec(self._same_as[node.name], index)
        if node.op == "placeholder":
            return self.by_placeholder.get(node.name, replicated(self.k))
        if node.op == "call_function" and node.target is operator.getitem:
            return self.spec(node.args[0], node.args[1])
        d = self.plan.nodes.get(node.name)
        if d is None:
            raise PlanError(f"the plan has no placement for {node.name} ({node.target}); the plan does not "
                             "match this graph, make a new one")
        if isinstance(d.output, list):
            return d.output[index if index is not None else 0]
        return d.output

    def input_specs(self, node: fx.Node) -> list:
        return list(self.plan.nodes[node.name].inputs)

    def output_specs(self, node: fx.Node) -> list:
        d = self.plan.nodes[node.name]
        return list(d.output) if isinstance(d.output, list) else [d.output]
