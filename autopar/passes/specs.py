"""Read the placements a Plan gives every value of the graph."""
from __future__ import annotations

import operator

import torch.fx as fx

from autopar.sharding.placements import R, parse_spec


class PlanSpecs:
    """``spec(node)``: the placement of a node's output under the plan."""

    def __init__(self, plan, mesh_ndim: int):
        self.plan = plan
        self.k = mesh_ndim
        self.by_placeholder = {p.placeholder: parse_spec(p.spec) for p in plan.params.values()}
        self.by_placeholder.update({k: parse_spec(v) for k, v in plan.inputs.items()})

    def spec(self, node: fx.Node, index: int | None = None):
        if node.op == "placeholder":
            return self.by_placeholder.get(node.name, tuple(R for _ in range(self.k)))
        if node.op == "call_function" and node.target is operator.getitem:
            return self.spec(node.args[0], node.args[1])
        d = self.plan.nodes.get(node.name)
        if d is None:
            return tuple(R for _ in range(self.k))
        if isinstance(d.output, list):
            return parse_spec(d.output[index if index is not None else 0])
        return parse_spec(d.output)

    def input_specs(self, node: fx.Node) -> list:
        return [parse_spec(s) for s in self.plan.nodes[node.name].inputs]

    def output_specs(self, node: fx.Node) -> list:
        d = self.plan.nodes[node.name]
        return [parse_spec(s) for s in d.output] if isinstance(d.output, list) else [parse_spec(d.output)]
