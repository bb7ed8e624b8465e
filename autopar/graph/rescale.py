"""The training step at another batch size, derived from two traces instead of tracing again.

Two traces of one model at b1 and b2 rows that differ only in integer arguments (sizes b,
b*seq, b*heads, slice ends) give every integer as an affine function of the batch:

    v(b) = v(b1) + (v(b1) - v(b2)) * (b - b1) / (b1 - b2)       (must come out integral)

The step at b rows is a copy of the b1 graph with those integers rewritten; its node values
(``meta["val"]``) come from fake-tensor propagation at b rows, which also checks every rewritten
size (a view whose sizes do not match its input fails there). Anything else that differs
between the two traces (an op, a name, a float such as 1/B, a sub-graph) means the graph does
not rescale and ``rescaled`` returns None: the caller traces again. A graph is the same
function at every batch only if the model's Python does not branch on the batch size; the
runtime therefore traces its microbatch step itself and checks the plan's fingerprint.
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.core.quiet_logs import quiet_fake_tensor_logs
from autopar.graph.meta_memo import MetaMemo


class _Differs(Exception):
    """The two traces differ in more than batch-affine integers."""


TRACE_FACTS = ("mixed_precision", "stored_dtypes")   # trace-wide meta a rescaled trace keeps (caches are dropped)


def reference_batches(batch: int) -> tuple[int, int] | None:
    """The two microbatch sizes to trace for rescaling a global batch of ``batch`` rows: ``batch``
    over its smallest prime factor, and that over its own; None unless both keep at least 2 rows
    (1 row may specialise size-1 dims). Both are sliced from the inputs as every microbatch is
    (the global trace may differ: an input passed twice, e.g. as input and target, is one
    placeholder there)."""
    def smaller(b):
        p = next((q for q in range(2, b + 1) if b % q == 0), None)
        return b // p if p is not None else 1

    b1 = smaller(batch)
    b2 = smaller(b1)
    return (b1, b2) if b2 >= 2 else None


def rescaled(first, second, batch: int):
    """``first`` (b1 rows) at ``batch`` rows, from ``second`` (the same step traced at b2 rows);
    None when the traces differ in more than batch-affine integers or propagation fails."""
    b1, b2 = first.batch_size, second.batch_size
    if b1 == b2 or batch < 1:
        return None
    try:
        graph = _rewritten(first.gm, second.gm, Fraction(batch - b1, b1 - b2))
        gm = fx.GraphModule(first.gm, graph)
        _propagate(gm, first, batch)
    except (_Differs, RuntimeError, ValueError, TypeError, IndexError):
        return None
    return dataclasses.replace(
        first, gm=gm, meta={k: v for k, v in first.meta.items() if k in TRACE_FACTS},
        input_shapes=[(batch,) + tuple(s[1:]) for s in first.input_shapes],
        target_shape=(batch,) + tuple(first.target_shape[1:]) if first.target_shape is not None else None)


def _rewritten(gm: fx.GraphModule, ref: fx.GraphModule, step: Fraction) -> fx.Graph:
    """A copy of ``gm``'s graph with each integer argument v moved to v + (v - v_ref) * step."""
    nodes, ref_nodes = list(gm.graph.nodes), list(ref.graph.nodes)
    if len(nodes) != len(ref_nodes) or _subgraphs(gm) != _subgraphs(ref):
        raise _Differs
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node, other in zip(nodes, ref_nodes):
        if (node.op, node.name, node.target) != (other.op, other.name, other.target):
            raise _Differs
        args = _moved(node.args, other.args, step)
        kwargs = _moved(node.kwargs, other.kwargs, step)
        copy = graph.create_node(node.op, node.target, fx.node.map_arg(args, lambda n: env[n]),
                                 fx.node.map_arg(kwargs, lambda n: env[n]), node.name, node.type)
        copy.meta = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta", "unbacked_bindings")}
        env[node] = copy
    return graph


def _moved(x, y, step: Fraction):
    if isinstance(x, fx.Node):
        if not isinstance(y, fx.Node) or x.name != y.name:
            raise _Differs
        return x
    if isinstance(x, (list, tuple)):
        if type(x) is not type(y) or len(x) != len(y):
            raise _Differs
        return type(x)(_moved(a, b, step) for a, b in zip(x, y))
    if isinstance(x, dict):
        if not isinstance(y, dict) or x.keys() != y.keys():
            raise _Differs
        return {k: _moved(x[k], y[k], step) for k in x}
    if isinstance(x, int) and not isinstance(x, bool) and type(y) is type(x) and x != y:
        v, rest = divmod(x * step.denominator + (x - y) * step.numerator, step.denominator)
        if rest:                # not integral (integer arithmetic: a Fraction per integer is slow)
            raise _Differs
        return v
    if type(x) is not type(y) or not _same(x, y):
        raise _Differs
    return x


def _same(x, y) -> bool:
    try:
        return bool(x == y)
    except Exception:  # noqa: BLE001 - e.g. a tensor argument: not comparable as one value
        return x is y


def _subgraphs(gm: fx.GraphModule) -> list[str]:
    """The code of every sub-graph (higher-order ops' bodies): they must be identical."""
    return [m.code for name, m in sorted(gm.named_modules()) if name and isinstance(m, fx.GraphModule)]


def _propagate(gm: fx.GraphModule, traced, batch: int) -> None:
    """Every node's value at ``batch`` rows (placeholders: inputs and target cut to ``batch``). A step
    traced on the meta device runs on plain meta tensors first (shapes, dtypes, strides and views as
    the fake tensors give them, without fake-tensor dispatch: several times faster; without autograd
    history, and each repeated call's output made from the first's, ``meta_memo.py``); where an op has
    no meta kernel, on fake tensors as any other step."""
    rows = set(traced.inputs) | ({traced.target} if traced.target else set())
    old_vals = {n.name: n.meta.get("val") for n in traced.gm.graph.nodes if n.op == "placeholder"}
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]

    def inputs():
        args = []
        for node in holders:
            old = old_vals[node.name]
            if not isinstance(old, torch.Tensor):
                args.append(old)
                continue
            shape = (batch,) + tuple(old.shape[1:]) if node.name in rows else tuple(old.shape)
            args.append(torch.empty(shape, dtype=old.dtype, device=old.device).requires_grad_(old.requires_grad))
        return args

    tensors = [v for v in old_vals.values() if isinstance(v, torch.Tensor)]
    if tensors and all(v.is_meta for v in tensors):
        try:
            with quiet_fake_tensor_logs(), torch.no_grad():
                _Values(gm, torch.device("meta"), MetaMemo()).run(*inputs())
            return
        except (RuntimeError, TypeError, ValueError, IndexError):
            pass                        # an op without a meta kernel: fake tensors below
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        args = inputs()
    on_meta = any(isinstance(a, torch.Tensor) and a.is_meta for a in args)
    with quiet_fake_tensor_logs(), mode:
        _Values(gm, torch.device("meta") if on_meta else None).run(*args)


class _Values(fx.Interpreter):
    """Runs the graph on fake tensors and keeps each node's value as export does: placeholders
    as given (parameters with ``requires_grad``), computed tensors detached, lists as they come;
    the output node keeps none. ``device``: a step traced on the meta device makes its own tensors
    (arange, zeros, ``.to``) on the device it runs on (``trace._retarget_device``), while export made
    them on meta; they are made on ``device`` here, as export did (else meta and cpu tensors meet)."""

    def __init__(self, gm: fx.GraphModule, device: torch.device | None = None, memo: MetaMemo | None = None):
        super().__init__(gm)
        self.device = device
        self.memo = memo

    def call_function(self, target, args, kwargs):
        if self.device is not None:
            args, kwargs = _on_device(args, self.device), _on_device(kwargs, self.device)
        if self.memo is not None:
            return self.memo.call(target, args, kwargs, super().call_function)
        return super().call_function(target, args, kwargs)

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if n.op == "placeholder":
            n.meta["val"] = out
        elif n.op != "output":
            n.meta["val"] = _detached(out)
        return out


def _on_device(x, device: torch.device):
    if isinstance(x, torch.device):
        return device
    if isinstance(x, (list, tuple)):
        return type(x)(_on_device(a, device) for a in x)
    if isinstance(x, dict):
        return {k: _on_device(v, device) for k, v in x.items()}
    return x


def _detached(v):
    if isinstance(v, torch.Tensor):
        return v.detach()
    if isinstance(v, (list, tuple)):
        return type(v)(_detached(x) for x in v)
    return v
