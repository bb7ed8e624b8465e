"""Rank 0's traced training step sent to the other ranks, so that one rank traces before planning.

``pack_traced(traced)`` -> bytes, or None where another process could not rebuild the graph from its
nodes alone; ``unpack_traced(data)`` -> the same :class:`Traced`.

What travels: every node's op, name, target, args and kwargs (nodes named), its ``meta`` with each
FakeTensor replaced by its shape, stride, storage offset, dtype, device and ``requires_grad`` (re-made
in one fresh FakeTensorMode on arrival), and the Traced's own fields. Refused (None: each rank traces
itself, as without sharing): ``get_attr``/``call_module``/``call_method`` nodes, higher-order ops, and
autopar's own custom ops (opaque autograd Functions, MoE experts): their implementations live in
registries that tracing fills in the tracing process.

The receiving rank checks the result as it checks its own trace: ``graph_fingerprint`` (every node's
op, name, target and shape) is compared across ranks after planning (``runtime/agreement.py``).
"""
from __future__ import annotations

import dataclasses
import pickle
import warnings

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_map

from autopar.frontend.trace import Traced

_OWN_NAMESPACES = ("autopar",)


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """A FakeTensor's description."""

    shape: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype
    device: str
    requires_grad: bool


@dataclasses.dataclass(frozen=True)
class _Ref:
    """A node used as an argument."""

    name: str


@dataclasses.dataclass(frozen=True)
class _Op:
    """An OpOverload, by its qualified name."""

    name: str


class _NotShareable(Exception):
    pass


def _describe(v):
    if isinstance(v, FakeTensor):
        return _Tensor(tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.dtype, str(v.device),
                       v.requires_grad)
    if isinstance(v, torch.Tensor):
        raise _NotShareable(f"a real tensor in node meta ({tuple(v.shape)})")
    return v


def _target(node: fx.Node):
    t = node.target
    if node.op in ("placeholder", "output"):
        return t
    if node.op != "call_function":
        raise _NotShareable(f"{node.op} node {node.name}")
    if isinstance(t, torch._ops.OpOverload):
        if t.namespace in _OWN_NAMESPACES:
            raise _NotShareable(f"process-registered op {t}")
        return _Op(t.name())
    if isinstance(t, torch._ops.HigherOrderOperator):
        raise _NotShareable(f"higher-order op {t}")
    return t


def pack_traced(traced: Traced) -> bytes | None:
    """``traced`` as bytes, or None where it holds something only the tracing process can run."""
    try:
        nodes = []
        for n in traced.gm.graph.nodes:
            args, kwargs = fx.node.map_aggregate((n.args, n.kwargs),
                                                 lambda a: _Ref(a.name) if isinstance(a, fx.Node) else a)
            meta = {k: tree_map(_describe, v) for k, v in n.meta.items()}
            nodes.append((n.op, n.name, _target(n), args, kwargs, meta))
        fields = {f.name: getattr(traced, f.name) for f in dataclasses.fields(traced) if f.name != "gm"}
        return pickle.dumps((nodes, fields), protocol=pickle.HIGHEST_PROTOCOL)
    except (_NotShareable, pickle.PicklingError, TypeError, AttributeError):
        return None


def _op(name: str):
    namespace, rest = name.split("::")
    op, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")


def unpack_traced(data: bytes) -> Traced:
    """The :class:`Traced` ``pack_traced`` described, its FakeTensors made in one new FakeTensorMode."""
    with warnings.catch_warnings():      # torch's own LeafSpec pickles through a deprecated isinstance
        warnings.simplefilter("ignore", FutureWarning)
        nodes, fields = pickle.loads(data)
    mode = FakeTensorMode()

    def make(d):
        if not isinstance(d, _Tensor):
            return d
        with mode:
            t = torch.empty_strided(d.shape, d.stride, dtype=d.dtype, device=d.device)
            if d.offset:
                t = t.as_strided(d.shape, d.stride, d.offset)
        return t.requires_grad_(d.requires_grad) if d.requires_grad else t

    graph, made = fx.Graph(), {}
    for op, name, target, args, kwargs, meta in nodes:
        args, kwargs = fx.node.map_aggregate((args, kwargs), lambda a: made[a.name] if isinstance(a, _Ref) else a)
        node = graph.create_node(op, _op(target.name) if isinstance(target, _Op) else target, args, kwargs,
                                 name=name)
        node.meta = {k: tree_map(make, v) for k, v in meta.items()}
        made[name] = node
    return Traced(gm=fx.GraphModule(torch.nn.Module(), graph), **fields)
