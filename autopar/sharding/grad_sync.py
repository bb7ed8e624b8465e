"""Which parameter gradients are summed over which mesh axes after backward: the one rule that
the cost side (``solver/decode.py``) and the lowering (``passes/insert_collectives.py``) share.

The gradient convention (docs/architecture.md) holds the gradient of a Replicate value in full on
every rank. Parameters are the exception that saves communication: a replicated parameter used by
a computation split on axis ``a`` gets a *partial* gradient there (each rank its share), and one
bucketed all-reduce after backward sums it. Every use must then leave a partial gradient, or the
sum counts a full gradient ``size(a)`` times.

Partial gradients pass unchanged through any op whose inputs are replicated on ``a`` and whose
gradient-carrying inputs are all parameter-derived in this way: its backward is the same linear
map on every rank, so it maps the sum of the partial output gradients to the sum of the partial
input gradients. Hence (per mesh axis ``a``):

    chain_a     trainable parameters that reach the loss, Replicate on ``a``; and every node that
                needs a gradient, is Replicate on ``a`` in and out (no redistribution on ``a``) and
                whose gradient-carrying tensor inputs are all in chain_a (``pos[:T]``, ``w.t()``,
                ``w1 + w2``).
    partial     a connected component K of chain_a is partial on ``a`` iff an edge leaves it
                (member u -> consumer v outside chain_a) where v wants u Replicate on ``a`` and
                v's output is split on ``a``: there u's gradient is a partial sum anyway.
    then        every parameter of a partial K is summed over ``a`` after backward, and every exit
                edge of K keeps its gradient partial: no Megatron ``f`` on ``a``, a consumer that
                runs replicated keeps the gradient on rank 0 only, R -> S slices and R -> P use
                the partial-gradient variants. A K that is not partial has full gradients on every
                rank and is summed nowhere.

Frozen parameters (``requires_grad=False``) and parameters with no differentiable path to the loss
get no gradient and no sync (found here, at plan time; nothing is discovered at run time).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch.fx as fx

from autopar.graph.grads import grad_nodes, is_parameter
from autopar.sharding.placements import Replicate
from autopar.sharding.strategy import tensor_inputs


@dataclass
class GradSyncRule:
    """The decision for one graph under one placement assignment (axes are mesh-axis indices)."""

    trainable: frozenset                                       # parameter placeholders that get a gradient
    partial: dict[str, frozenset] = field(default_factory=dict)  # node -> axes its gradient is partial on
    members: dict[str, frozenset] = field(default_factory=dict)  # node -> axes it is a chain member on
    param_axes: dict[str, frozenset] = field(default_factory=dict)  # parameter placeholder -> summed axes

    def partial_axes(self, node: fx.Node) -> frozenset:
        return self.partial.get(_source(node).name, frozenset())

    def exit_axes(self, src: fx.Node, consumer: fx.Node) -> frozenset:
        """Axes on which the edge src -> consumer leaves a partial component (consumer outside it)."""
        return self.partial_axes(src) - self.members.get(consumer.name, frozenset())


def _source(node: fx.Node) -> fx.Node:
    if node.op == "call_function" and node.target is operator.getitem:
        return node.args[0]
    return node


def _index(node: fx.Node):
    if node.op == "call_function" and node.target is operator.getitem:
        return node.args[1]
    return None


def reaching_loss(graph: fx.Graph, loss: fx.Node | None) -> set[fx.Node]:
    """Nodes with a differentiable path to ``loss`` (every output when there is no loss)."""
    need = grad_nodes(graph)
    out = next(n for n in graph.nodes if n.op == "output")
    roots = [loss] if loss is not None else [a for a in out.all_input_nodes]
    seen: set[fx.Node] = set()
    stack = [r for r in roots if r in need]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(a for a in n.all_input_nodes if a in need and a not in seen)
    return seen


def trainable_params(graph: fx.Graph, params: set[str], loss: fx.Node | None) -> frozenset:
    """Parameter placeholders that receive a gradient: ``requires_grad`` and a path to the loss."""
    reach = reaching_loss(graph, loss)
    return frozenset(n.name for n in graph.nodes
                     if n.op == "placeholder" and n.name in params and is_parameter(n) and n in reach)


def grad_sync_rule(graph: fx.Graph, trainable: frozenset, specs, ndim: int) -> GradSyncRule:
    """The rule of the module docstring. ``specs`` answers ``has(node)``, ``spec(node, index)``,
    ``input_specs(node)`` (one per tensor input) and ``output_specs(node)``."""
    need = grad_nodes(graph)
    rule = GradSyncRule(trainable=trainable)
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    for a in range(ndim):
        members = _chain(graph, trainable, placeholders, specs, need, a)
        comps = _components(members)
        partial_roots = {comps[u] for u in members for v, want in _exits(u, members, specs)
                         if _replicated_use_split(specs, u, v, want, a)}
        for name in members:
            rule.members[name] = rule.members.get(name, frozenset()) | {a}
            if comps[name] in partial_roots:
                rule.partial[name] = rule.partial.get(name, frozenset()) | {a}
                if name in trainable:
                    rule.param_axes[name] = rule.param_axes.get(name, frozenset()) | {a}
    return rule


def _chain(graph, trainable, placeholders, specs, need, a) -> dict[str, fx.Node]:
    members = {n: placeholders[n] for n in sorted(trainable)        # sorted: the same order on every rank
               if isinstance(specs.spec(placeholders[n])[a], Replicate)}
    for node in graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem or node not in need or not specs.has(node):
            continue
        if not all(isinstance(o[a], Replicate) for o in specs.output_specs(node)):
            continue
        ins, wants = tensor_inputs(node), specs.input_specs(node)
        if len(ins) != len(wants):
            continue
        ok = True
        for src, want in zip(ins, wants):
            have = specs.spec(_source(src), _index(src))
            if not (isinstance(want[a], Replicate) and isinstance(have[a], Replicate)):
                ok = False
            elif src in need and _source(src).name not in members:
                ok = False
            if not ok:
                break
        if ok:
            members[node.name] = node
    return members


def _components(members: dict[str, fx.Node]) -> dict[str, str]:
    parent = {n: n for n in members}

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for name, node in members.items():
        if node.op != "call_function":
            continue
        for src in tensor_inputs(node):
            s = _source(src).name
            if s in parent:
                parent[find(s)] = find(name)
    return {n: find(n) for n in members}


def _exits(name: str, members: dict, specs):
    """(consumer, wanted spec) of every use of member ``name`` by a node outside the chain."""
    node = members[name]
    users = []
    for u in node.users:
        if u.op == "call_function" and u.target is operator.getitem:
            users.extend((g, u) for g in u.users)
        else:
            users.append((u, node))
    for consumer, via in users:
        if consumer.name in members or consumer.op != "call_function" or not specs.has(consumer):
            continue
        wants = specs.input_specs(consumer)
        for src, want in zip(tensor_inputs(consumer), wants):
            if src is via:
                yield consumer, want


def _replicated_use_split(specs, u: str, consumer: fx.Node, want, a: int) -> bool:
    return isinstance(want[a], Replicate) and any(not isinstance(o[a], Replicate)
                                                  for o in specs.output_specs(consumer))
