"""Turn a solved strategy choice into Plan decisions: placements, gradient-sync axes, the
collectives one step runs, and per-node option costs for ``plan.explain``."""
from __future__ import annotations

import operator

import numpy as np
import torch.fx as fx

from autopar.graph.grads import grad_nodes
from autopar.plan.plan import Collective, NodeDecision, ParamDecision
from autopar.sharding.candidates import Candidates, producer
from autopar.sharding.grad_sync import grad_sync_rule, trainable_params
from autopar.sharding.placements import Partial, Spec, shard_factor
from autopar.sharding.edge import edge_collectives
from autopar.sharding.redistribute import step_bytes
from autopar.sharding.strategy import tensor_inputs
from autopar.solver.problem import BuiltProblem
from autopar.solver.strategy_prices import Costing, local_impl_times, split_axes, tensor_bytes


def _spec_out(st, idx):
    return st.output if idx is None else st.output[idx]


class ChosenSpecs:
    """The placements of a solved strategy choice, asked the way ``PlanSpecs`` answers for a Plan."""

    def __init__(self, chosen: dict):
        self.chosen = chosen

    def has(self, node: fx.Node) -> bool:
        return node.op == "call_function" and node.name in self.chosen

    def spec(self, node: fx.Node, index=None):
        src, idx = producer(node) if index is None else (node, index)
        return _spec_out(self.chosen[src.name], idx)

    def input_specs(self, node: fx.Node) -> list:
        return list(self.chosen[node.name].inputs)

    def output_specs(self, node: fx.Node) -> list:
        o = self.chosen[node.name].output
        return list(o) if o and isinstance(o[0], tuple) else [o]


def _itemsize(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def loss_report_collectives(gm: fx.GraphModule, outputs: dict, axis_names: tuple, traced) -> list[Collective]:
    """``ParallelModule.step`` returns the global loss: a Partial loss is summed over each of its
    Partial axes (``ParallelModule._start_global_loss``), overlapped with backward."""
    node = loss_output(gm, traced)
    spec = outputs.get("loss")
    if node is None or not spec:
        return []
    size = _itemsize(node.meta["val"].dtype)
    return [Collective("all_reduce", size, [axis_names[a]], "fwd", "", 0.0)
            for a, p in enumerate(spec) if isinstance(p, Partial)]


def loss_output(gm: fx.GraphModule, traced) -> fx.Node | None:
    if traced.loss_index is None:
        return None
    node = next(n for n in gm.graph.nodes if n.op == "output").args[0][traced.loss_index]
    return node if isinstance(node, fx.Node) else None


def decode(gm: fx.GraphModule, cands: Candidates, built: BuiltProblem, choice: list[int], c: Costing,
           axis_names: tuple, traced) -> tuple[dict, dict, dict, list[Collective]]:
    """Returns (node decisions, param/buffer decisions, input specs, collectives)."""
    chosen = {n: cands.strategies[n][choice[i]] for i, n in enumerate(built.names)}
    by_name = {n.name: n for n in gm.graph.nodes}
    nodes, collectives = {}, []
    emitted: set = set()
    need = grad_nodes(gm.graph)      # values that get a gradient: only they run backward collectives
    rule = grad_sync_rule(gm.graph, trainable_params(gm.graph, set(traced.params), loss_output(gm, traced)),
                          ChosenSpecs(chosen), len(axis_names))
    p = built.problem
    in_edges: dict[int, list] = {}
    out_edges: dict[int, list] = {}
    for e in p.edges:
        in_edges.setdefault(e.dst, []).append(e)
        out_edges.setdefault(e.src, []).append(e)
    for name, st in chosen.items():
        node = by_name[name]
        if node.op != "call_function":
            continue
        v = built.index[name]
        totals = np.array(p.nodes[v].compute, dtype=float)
        for e in in_edges.get(v, []):
            totals = totals + e.cost[choice[e.src], :]
        for e in out_edges.get(v, []):
            totals = totals + e.cost[:, choice[e.dst]]
        order = np.argsort(totals)[:6]
        options = [[cands.strategies[name][int(i)].describe(), float(totals[i])] for i in order]
        out = [Spec(o) for o in st.output] if st.output and isinstance(st.output[0], tuple) else Spec(st.output)
        nodes[name] = NodeDecision(op=str(node.target), strategy=st.name, inputs=[Spec(s) for s in st.inputs],
                                   output=out, local=list(st.local), module=node.meta.get("module_path", ""),
                                   time=float(p.nodes[v].compute[choice[v]]), options=options)
        ins = tensor_inputs(node)
        split = split_axes(st)
        for i, a in enumerate(ins):
            src, idx = producer(a)
            if src.name not in chosen:
                continue
            have = _spec_out(chosen[src.name], idx)
            edge = edge_collectives(have, st.inputs[i], split, rule.partial_axes(a), rule.exit_axes(a, node))
            key = (src.name, idx, edge)
            if key in emitted:       # consumers needing the same collectives share them
                continue
            emitted.add(key)
            local = tensor_bytes(src, idx) / shard_factor(have, c.mesh_shape)
            for j, step in enumerate(edge.steps):
                moved, after = step_bytes(step, local, c.mesh_shape)
                fwd = edge.forward(j)
                if fwd:
                    collectives.append(Collective(fwd, int(moved), [axis_names[step.axis]], "fwd", name,
                                                  c.comm(fwd, moved, step.axis)))
                bwd = edge.backward(j) if a in need else None
                if bwd:
                    collectives.append(Collective(bwd, int(moved), [axis_names[step.axis]], "bwd", name,
                                                  c.comm(bwd, moved, step.axis)))
                local = after
            if a in need:            # Megatron's f: the activation gradient summed over the axis
                nbytes = tensor_bytes(a) / shard_factor(st.inputs[i], c.mesh_shape)
                for ax in edge.grad_sum:
                    collectives.append(Collective("all_reduce", int(nbytes), [axis_names[ax]], "bwd", name,
                                                  c.comm("all_reduce", nbytes, ax)))
        for kind, nbytes, ax, phase, seconds in local_impl_times(node, st, c):
            collectives.append(Collective(kind, int(nbytes), [axis_names[ax]], phase, name, seconds))
    params = {}
    for ph, pname in traced.params.items():
        if ph not in chosen:
            continue
        val = by_name[ph].meta["val"]
        sync = sorted((axis_names[a] for a in rule.param_axes.get(ph, ())), key=axis_names.index)
        dtype = traced.meta.get("stored_dtypes", {}).get(pname, val.dtype)
        params[pname] = ParamDecision(Spec(chosen[ph].output), list(val.shape), str(dtype).replace("torch.", ""),
                                      ph, list(traced.aliases.get(pname, [pname])), sync, "parameter",
                                      ph in rule.trainable)
        if sync:
            nbytes = tensor_bytes(by_name[ph]) / shard_factor(chosen[ph].output, c.mesh_shape)
            collectives.append(Collective("all_reduce", int(nbytes), sync, "bwd", ph,
                                          sum(c.grad_sync(nbytes, axis_names.index(a)) for a in sync)))
    for ph, bname in list(traced.buffers.items()) + [(k, k) for k in traced.constants]:
        if ph in chosen:
            val = by_name[ph].meta["val"]
            kind = "buffer" if ph in traced.buffers else "constant"
            params[bname] = ParamDecision(Spec(chosen[ph].output), list(val.shape),
                                          str(val.dtype).replace("torch.", ""), ph, [bname], [], kind)
    inputs = {ph: Spec(chosen[ph].output) for ph in traced.inputs + ([traced.target] if traced.target else [])
              if ph in chosen}
    return nodes, params, inputs, collectives


def output_specs(gm: fx.GraphModule, nodes: dict, params: dict, inputs: dict, traced) -> dict:
    """``{"loss": spec, "output": [spec per leaf of the model's output (None for a non-tensor leaf)]}``."""
    vals = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    result = {}
    if traced.loss_index is not None and isinstance(vals[traced.loss_index], fx.Node):
        result["loss"] = _spec_of(vals[traced.loss_index], nodes, params, inputs)
    if traced.output_leaves:
        result["output"] = [_spec_of(vals[i], nodes, params, inputs) if isinstance(vals[i], fx.Node) else None
                            for i in traced.output_leaves]
    return result


def _spec_of(node: fx.Node, nodes, params, inputs):
    if node.op == "call_function" and node.target is operator.getitem:
        src, idx = node.args
        d = nodes.get(src.name)
        return d.output[idx] if d else None
    if node.name in nodes:
        return nodes[node.name].output
    if node.name in inputs:
        return inputs[node.name]
    for p in params.values():
        if p.placeholder == node.name:
            return p.spec
    return None
