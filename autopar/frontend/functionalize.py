"""In-place writes into intermediate tensors made functional before planning.

torch.export's training IR keeps in-place ops. On parameters and buffers autopar handles them
(``graph/buffer_writes.py``); on an intermediate tensor they are a hazard: DeepSeek-V3's latent
attention fills ``new_empty(...)`` through ``key_states[..., :n].copy_(k_nope)``, Hugging Face's grouped-mm
experts fill an ``empty_like`` with ``index_put_``. Once the plan puts a collective between a view and its
base, the write lands in the collective's output and the base stays uninitialized (a NaN loss). When the
graph writes into anything but a graph input, ``functional(ep)`` re-runs torch's functionalization
(``run_decompositions({})``: no op decomposed, writes into views become ``slice_scatter`` / out-of-place ops;
the ``aten.copy`` it leaves, which has no derivative, becomes ``expand`` + ``clone``).
"""
from __future__ import annotations

import torch
import torch.fx as fx

_aten = torch.ops.aten
_ALLOCATIONS = {_aten.empty, _aten.empty_like, _aten.new_empty, _aten.empty_strided, _aten.new_empty_strided,
                _aten.zeros, _aten.zeros_like, _aten.new_zeros, _aten.full, _aten.full_like, _aten.new_full,
                _aten.ones, _aten.ones_like, _aten.new_ones}


def _hazard(a: fx.Node) -> bool:
    """A tensor whose in-place fill other nodes read through another name: a view of something
    (its base sees the write) or a fresh allocation filled in place. An in-place op on an ordinary
    value (``relu_`` after a convolution) is left as it is: its users read the op's result."""
    target = a.target
    if a.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target.overloadpacket in _ALLOCATIONS:
        return True
    returns = target._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def writes_intermediates(gm: fx.GraphModule) -> bool:
    """Whether an in-place op writes into a view or a fresh allocation (not a graph input)."""
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        for arg, a in zip(target._schema.arguments, node.args):
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(a, fx.Node) \
                    and a.op != "placeholder" and _hazard(a):
                return True
    return False


def _differentiable_copies(gm: fx.GraphModule) -> None:
    """Functionalization leaves ``aten.copy(self, src)`` (``src`` broadcast to ``self``'s shape, in its
    dtype), which has no derivative: each becomes ``expand`` + ``clone`` (or ``_to_copy``), which do."""
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.copy.default:
            continue
        dst, src = node.args[0], node.args[1]
        want, have = node.meta["val"], src.meta["val"]
        with gm.graph.inserting_before(node):
            x = src
            if tuple(have.shape) != tuple(want.shape):
                x = gm.graph.call_function(aten.expand.default, (src, list(want.shape)))
                x.meta.update(node.meta)
            if have.dtype != want.dtype:
                new = gm.graph.call_function(aten._to_copy.default, (x,), {"dtype": want.dtype})
            else:
                new = gm.graph.call_function(aten.clone.default, (x,))
            new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        del dst
    gm.recompile()


def functional(ep):
    """``ep`` itself, or its functionalized program when it writes into intermediates."""
    if not writes_intermediates(ep.graph_module):
        return ep
    ep = ep.run_decompositions({})
    _differentiable_copies(ep.graph_module)
    return ep
