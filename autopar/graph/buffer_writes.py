"""Buffers a traced step writes in place.

torch.export keeps a training-mode ``aten.batch_norm`` (and the ``add_`` on its
``num_batches_tracked``) as in-place writes to the buffer placeholders instead of functional
``BUFFER_MUTATION`` outputs, so a graph's outputs alone do not tell whether its forward updates
buffers. This walks the graph: every argument an op's schema marks written (``Tensor(a!)``),
followed back through views to its placeholder, plus ``aten.batch_norm``'s running statistics in
training (its schema does not mark them, its kernel updates them).
"""
from __future__ import annotations

import torch
from torch import fx
from torch.ops import aten


def _written_args(node: fx.Node) -> list:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return []
    out = []
    for i, a in enumerate(target._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            out.append(node.args[i] if i < len(node.args) else node.kwargs.get(a.name))
    if target is aten.batch_norm.default:
        training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training", False)
        if training:
            out += [node.args[i] if i < len(node.args) else node.kwargs.get(k)
                    for i, k in ((3, "running_mean"), (4, "running_var"))]
    return [a for a in out if isinstance(a, fx.Node)]


def _base(node: fx.Node) -> fx.Node:
    """The tensor ``node`` is a view of: follows ops whose output aliases their first argument."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.args:
        returns = node.target._schema.returns
        if not (returns and returns[0].alias_info is not None and isinstance(node.args[0], fx.Node)):
            break
        node = node.args[0]
    return node


def written_buffers(gm: fx.GraphModule, buffers: dict[str, str]) -> set[str]:
    """Names (the model's) of the buffers ``gm`` writes in place; ``buffers``: placeholder -> name."""
    out = set()
    for node in gm.graph.nodes:
        for arg in _written_args(node):
            base = _base(arg)
            if base.op == "placeholder" and base.name in buffers:
                out.add(buffers[base.name])
    return out


def updates_buffers(traced) -> bool:
    """Whether the traced step's forward updates buffers (functional mutation outputs or in-place
    writes): splitting its batch into microbatches (a pipeline, accumulation) would then change
    what it computes (BatchNorm's statistics would be a microbatch's)."""
    return bool(traced.buffer_mutations) or bool(written_buffers(traced.gm, traced.buffers))
