"""Turn a solved strategy choice into Plan decisions: placements, gradient-sync axes, the
collectives one step runs, and per-node option costs for ``plan.explain``."""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import numpy as np
import torch.fx as fx

from autopar.core import search_memo
from autopar.graph.grads import grad_nodes
from autopar.plan.plan import Collective, NodeDecision, ParamDecision
from autopar.sharding.candidates import Candidates, producer
from autopar.sharding.grad_sync import grad_sync_rule, trainable_params
from autopar.sharding.placements import Partial, Spec, shard_factor
from autopar.sharding.edge import edge_collectives
from autopar.sharding.redistribute import step_bytes
from autopar.sharding.strategy import tensor_inputs
from autopar.solver.problem import BuiltProblem
from autopar.solver.recompute_collectives import RECOMPUTE_PHASE, region_of, same_region
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
    nodes = {}
    rule = grad_sync_rule(gm.graph, trainable_params(gm.graph, set(traced.params), loss_output(gm, traced)),
                          ChosenSpecs(chosen), len(axis_names))
    listed = _StepCollectives(c, axis_names, rule, grad_nodes(gm.graph), region=region_of(gm, c.recompute))
    p = built.problem
    edges_at = _edges_at(p)
    options = _shared_options(edges_at) if search_memo.ENABLED else _options
    for name, st in chosen.items():
        node = by_name[name]
        if node.op != "call_function":
            continue
        v = built.index[name]
        nodes[name] = _node_decision(node, st, float(p.nodes[v].compute[choice[v]]),
                                     options(cands.strategies[name], v, p, choice, edges_at))
        listed.of_inputs(node, st, chosen)
        listed.of_local_impl(node, st)
    params = _param_decisions(traced, chosen, by_name, listed)
    inputs = {ph: Spec(chosen[ph].output) for ph in traced.inputs + ([traced.target] if traced.target else [])
              if ph in chosen}
    return nodes, params, inputs, listed.out


def _edges_at(p) -> tuple[dict[int, list], dict[int, list]]:
    """(node -> the problem's edges into it, node -> the edges out of it)."""
    in_edges: dict[int, list] = {}
    out_edges: dict[int, list] = {}
    for e in p.edges:
        in_edges.setdefault(e.dst, []).append(e)
        out_edges.setdefault(e.src, []).append(e)
    return in_edges, out_edges


def _options(strategies: list, v: int, p, choice: list[int], edges_at: tuple) -> list:
    """[description, seconds] of node ``v``'s six cheapest strategies, its neighbours' choices fixed
    (its own seconds plus its edges' resharding), for ``plan.explain``."""
    in_edges, out_edges = edges_at
    totals = np.array(p.nodes[v].compute, dtype=float)
    for e in in_edges.get(v, []):
        totals = totals + e.cost[choice[e.src], :]
    for e in out_edges.get(v, []):
        totals = totals + e.cost[:, choice[e.dst]]
    order = np.argsort(totals)[:6]
    return [[_described(strategies[int(i)]), float(totals[i])] for i in order]


def _shared_options(edges_at: tuple):
    """``_options`` once per class of alike nodes within one decode: two nodes with the same strategy list
    object, equal prices and the same edge tables (objects, shared by repeated layers) at the same
    neighbour choices get equal lists (each node its own copy)."""
    in_edges, out_edges = edges_at
    kept: dict = {}

    def options(strategies: list, v: int, p, choice: list[int], _edges_at) -> list:
        key = (id(strategies), p.nodes[v].compute.tobytes(),
               tuple((id(e.cost), choice[e.src]) for e in in_edges.get(v, [])),
               tuple((id(e.cost), choice[e.dst]) for e in out_edges.get(v, [])))
        hit = kept.get(key)
        if hit is None:
            hit = kept[key] = (strategies, _options(strategies, v, p, choice, edges_at))
        return [list(o) for o in hit[1]]
    return options


_DESCRIBED: dict[int, tuple] = {}      # id(strategy) -> (strategy, its ``describe()``)


def _described(st) -> str:
    """``st.describe()``, memoised per Strategy object (repeated layers share them; the entry keeps
    the object alive, so an id is not reused while it is listed)."""
    if not search_memo.ENABLED:
        return st.describe()
    hit = _DESCRIBED.get(id(st))
    if hit is None or hit[0] is not st:
        if len(_DESCRIBED) > 200_000:
            _DESCRIBED.clear()
        hit = _DESCRIBED[id(st)] = (st, st.describe())
    return hit[1]


def _node_decision(node: fx.Node, st, seconds: float, options: list) -> NodeDecision:
    out = [Spec(o) for o in st.output] if st.output and isinstance(st.output[0], tuple) else Spec(st.output)
    return NodeDecision(op=str(node.target), strategy=st.name, inputs=[Spec(s) for s in st.inputs],
                        output=out, local=list(st.local), module=node.meta.get("module_path", ""),
                        time=seconds, options=options)


@dataclass
class _StepCollectives:
    """The collectives one step runs, listed in the plan's order: per node its inputs' redistributions
    and activation-gradient sums, then its local implementation's; the parameters' gradient syncs last."""

    c: Costing
    axis_names: tuple
    rule: object                    # sharding.grad_sync's rule for this choice
    need: frozenset                 # values that get a gradient: only they run backward collectives
    out: list[Collective] = field(default_factory=list)
    emitted: set = field(default_factory=set)
    region: dict = field(default_factory=dict)   # node -> its recomputed region (``recompute_collectives``)

    def add(self, kind: str, nbytes: float, axis: int, phase: str, name: str) -> None:
        self.out.append(Collective(kind, int(nbytes), [self.axis_names[axis]], phase, name,
                                   self.c.comm(kind, nbytes, axis)))

    def of_inputs(self, node: fx.Node, st, chosen: dict) -> None:
        c, name, split = self.c, node.name, split_axes(st)
        for i, a in enumerate(tensor_inputs(node)):
            src, idx = producer(a)
            if src.name not in chosen:
                continue
            have = _spec_out(chosen[src.name], idx)
            edge = edge_collectives(have, st.inputs[i], split, self.rule.partial_axes(a), self.rule.exit_axes(a, node))
            key = (src.name, idx, edge)
            if key in self.emitted:       # consumers needing the same collectives share them
                continue
            self.emitted.add(key)
            local = tensor_bytes(src, idx) / shard_factor(have, c.mesh_shape)
            for j, step in enumerate(edge.steps):
                moved, after = step_bytes(step, local, c.mesh_shape)
                fwd = edge.forward(j)
                if fwd:
                    self.add(fwd, moved, step.axis, "fwd", name)
                    if same_region(self.region, src.name, name):     # the region's forward runs again
                        self.add(fwd, moved, step.axis, RECOMPUTE_PHASE, name)
                bwd = edge.backward(j) if a in self.need else None
                if bwd:
                    self.add(bwd, moved, step.axis, "bwd", name)
                local = after
            if a in self.need:            # Megatron's f: the activation gradient summed over the axis
                nbytes = tensor_bytes(a) / shard_factor(st.inputs[i], c.mesh_shape)
                for ax in edge.grad_sum:
                    self.add("all_reduce", nbytes, ax, "bwd", name)

    def of_local_impl(self, node: fx.Node, st) -> None:
        timed = list(local_impl_times(node, st, self.c))
        if node.name in self.region:                                  # recomputed: its forward ones again
            timed += [(kind, b, ax, RECOMPUTE_PHASE, t) for kind, b, ax, phase, t in timed if phase == "fwd"]
        for kind, nbytes, ax, phase, seconds in timed:
            self.out.append(Collective(kind, int(nbytes), [self.axis_names[ax]], phase, node.name, seconds,
                                       in_node=True))


def _param_decisions(traced, chosen: dict, by_name: dict, listed: _StepCollectives) -> dict:
    """Parameter, buffer and constant decisions; each synced parameter's gradient all-reduce is listed."""
    c, axis_names, rule = listed.c, listed.axis_names, listed.rule
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
            listed.out.append(Collective("all_reduce", int(nbytes), sync, "bwd", ph,
                                         sum(c.grad_sync(nbytes, axis_names.index(a)) for a in sync)))
    for ph, bname in list(traced.buffers.items()) + [(k, k) for k in traced.constants]:
        if ph in chosen:
            val = by_name[ph].meta["val"]
            kind = "buffer" if ph in traced.buffers else "constant"
            params[bname] = ParamDecision(Spec(chosen[ph].output), list(val.shape),
                                          str(val.dtype).replace("torch.", ""), ph, [bname], [], kind)
    return params


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
