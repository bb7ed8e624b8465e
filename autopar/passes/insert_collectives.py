"""Insert the collectives that move each value from its producer's placement to the one its
consumer's strategy needs, plus Megatron's ``f`` (identity forward, gradient all-reduce)
where a Replicate input feeds a split computation, and swap in local implementations.

Parameters whose gradient is summed over an axis after backward (``sharding/grad_sync.py``, the
rule the cost side shares) are not given ``f`` ops there: their axes are returned so the runtime
syncs them in buckets after backward (DDP's reducer).
"""
from __future__ import annotations

import operator

import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.collectives import comm, local_ops
from autopar.plan.plan import PlanError
from autopar.plan.specs import PlanSpecs
from autopar.sharding.candidates import is_dropped
from autopar.sharding.grad_sync import grad_sync_rule, trainable_params
from autopar.sharding.placements import Replicate
from autopar.sharding.edge import EdgeCollectives, edge_collectives
from autopar.sharding.strategy import tensor_inputs

_STEP_FN = {"all_gather": comm.all_gather, "all_reduce": comm.all_reduce, "reduce_scatter": comm.reduce_scatter,
            "all_to_all": comm.all_to_all, "local_slice": comm.local_slice, "to_partial": comm.to_partial}


def _split_axes(out_specs) -> set[int]:
    return {a for o in out_specs for a, p in enumerate(o) if not isinstance(p, Replicate)}


def _zz(st) -> tuple:
    """The zig-zag flag as a trailing argument, only where set (``print(pmodel.code)`` stays as it was)."""
    return (True,) if st.zigzag else ()


def _emit_steps(graph: fx.Graph, value: fx.Node, edge: EdgeCollectives, axis_names) -> fx.Node:
    """Emit one use's redistribution as ``edge`` (``sharding/edge.py``) decides it: an all-gather
    in ``edge.fused`` gets reduce-scatter backward; on ``edge.pgrad`` local steps keep partial
    gradients; then the grad_all_reduces (Megatron's f) and partial_grads."""
    for i, st in enumerate(edge.steps):
        name = axis_names[st.axis]
        if st.kind == "all_gather":
            fn = comm.all_gather_rs if i in edge.fused else comm.all_gather
            value = graph.call_function(fn, (value, st.dim, name, st.chunks, *_zz(st)))
        elif st.kind == "local_slice" and st.axis in edge.pgrad:
            value = graph.call_function(comm.local_slice_pgrad, (value, st.dim, name, st.chunks, *_zz(st)))
        elif st.kind == "to_partial" and st.axis in edge.pgrad:
            value = graph.call_function(comm.to_partial_pgrad, (value, name))
        elif st.kind in ("reduce_scatter", "local_slice"):
            value = graph.call_function(_STEP_FN[st.kind], (value, st.dim, name, st.chunks, *_zz(st)))
        elif st.kind == "all_to_all":
            value = graph.call_function(comm.all_to_all, (value, st.dim, st.dst_dim, name))
        else:
            value = graph.call_function(_STEP_FN[st.kind], (value, name))
    for a in edge.grad_sum:
        value = graph.call_function(comm.grad_all_reduce, (value, axis_names[a]))
    for a in edge.once:
        value = graph.call_function(comm.partial_grad, (value, axis_names[a]))
    return value


def insert_collectives(gm: fx.GraphModule, plan, axis_names: tuple, mesh_shape: tuple, param_placeholders: set[str],
                       loss_index: int | None = None) -> tuple[fx.GraphModule, dict[str, set[str]]]:
    """Rewrite ``gm`` in place for this plan; returns (gm, parameter placeholder -> grad-sync axes)."""
    specs = PlanSpecs(plan, len(axis_names))
    graph = gm.graph
    for node in graph.nodes:
        if node.name in plan.nodes:
            _check_local(node, plan.nodes[node.name], axis_names)
    rule = grad_sync_rule(graph, trainable_params(graph, param_placeholders, loss_node(graph, loss_index)), specs,
                          len(axis_names))
    cache: dict = {}  # (value, edge) -> node: consumers needing the same collectives share them
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        if is_dropped(node):
            graph.erase_node(node)
            continue
        decision = plan.nodes.get(node.name)
        if decision is None:
            continue
        ins = tensor_inputs(node)
        need = specs.input_specs(node)
        if len(ins) != len(need):
            raise PlanError(f"the plan gives {node.name} ({node.target}) {len(need)} input placement(s) but it has "
                             f"{len(ins)} tensor input(s); the plan does not match this graph, make a new one")
        outs = specs.output_specs(node)
        split = _split_axes(outs)
        new_inputs = []
        with graph.inserting_before(node):
            for i, src in enumerate(ins):
                edge = edge_collectives(specs.spec(src), need[i], split, rule.partial_axes(src),
                                        rule.exit_axes(src, node))
                key = (src, edge)
                if key not in cache:
                    cache[key] = _emit_steps(graph, src, edge, axis_names)
                new_inputs.append(cache[key])
        _replace_tensor_inputs(node, new_inputs)
        _apply_local(gm, node, decision, axis_names, mesh_shape, specs)
    _lower_always_local(graph)
    graph.lint()
    gm.recompile()
    return gm, {ph: {axis_names[a] for a in axes} for ph, axes in rule.param_axes.items()}


def loss_node(graph: fx.Graph, loss_index: int | None) -> fx.Node | None:
    """The graph output that is the loss (None: no loss, every output counts)."""
    if loss_index is None:
        return None
    out = next(n for n in graph.nodes if n.op == "output")
    node = out.args[0][loss_index]
    return node if isinstance(node, fx.Node) else None


def _replace_tensor_inputs(node: fx.Node, new_inputs: list[fx.Node]) -> None:
    flat, spec = tree_flatten((node.args, node.kwargs))
    it = iter(new_inputs)
    tensor_ids = {id(a) for a in tensor_inputs(node)}
    out = []
    for a in flat:
        if isinstance(a, fx.Node) and id(a) in tensor_ids:
            out.append(next(it))
        else:
            out.append(a)
    args, kwargs = tree_unflatten(out, spec)
    node.args, node.kwargs = tuple(args), dict(kwargs)


def _check_local(node: fx.Node, decision, axis_names) -> None:
    if len(decision.local) != len(axis_names):
        raise ValueError(f"the plan's decision for {node.name} names local implementations for "
                         f"{len(decision.local)} mesh axes, the mesh has {len(axis_names)} {tuple(axis_names)}; "
                         "the plan is inconsistent, make a new one")


def _lower_always_local(graph: fx.Graph) -> None:
    """Every node of an op that never runs as itself (``local_ops.ALWAYS_LOCAL``: ``autopar::moe_experts``)
    and still calls it (replicated on every axis, a 1-device mesh, STAND_ALONE, no plan decision) runs
    its local implementation with no roles."""
    for node in graph.nodes:
        family = local_ops.ALWAYS_LOCAL.get(node.target) if node.op == "call_function" else None
        if family is not None:
            node.kwargs = dict(node.kwargs, _op=node.target.__name__.split(".")[0], _axes={})
            node.target = local_ops.IMPLS[family]


def _apply_local(gm: fx.GraphModule, node: fx.Node, decision, axis_names, mesh_shape, specs: PlanSpecs) -> None:
    roles = [(axis_names[a], name.split(":")[1]) for a, name in enumerate(decision.local) if name]
    if not roles:
        return
    family = decision.local[[i for i, n in enumerate(decision.local) if n][0]].split(":")[0]
    if family == "mean":
        factor = 1
        for a, name in enumerate(decision.local):
            if name:
                factor *= mesh_shape[a]
        with gm.graph.inserting_after(node):
            scaled = gm.graph.call_function(local_ops.scale, (node, 1.0 / factor))
        scaled.meta = dict(node.meta)
        node.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)
        specs.same_as(scaled, node)
        return
    impl = local_ops.IMPLS[family]
    axes = {role: [a for a, r in roles if r == role] for role in {r for _, r in roles}}
    node.kwargs = dict(node.kwargs, _op=node.target.__name__.split(".")[0], _axes=axes)
    if family in ("attn_gather", "attn_ring") and any(getattr(p, "zigzag", False) for p in specs.input_specs(node)[0]):
        node.kwargs = dict(node.kwargs, _zigzag=True)   # the sequence in the zig-zag order (``Z(dim)``): positions follow it
    node.target = impl
