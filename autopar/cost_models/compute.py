"""Compute cost of graph nodes: FLOPs and bytes -> roofline time, forward and backward.

Work (device-independent, cached per op signature) comes from running the node's op on
fake tensors of the node's shapes, forward and then backward through autograd:

- FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` (matmuls, convolutions, attention
  where registered). Where it counts nothing, formulas: scaled_dot_product_attention
  ``fwd = 4*b*heads*Sq*Sk*d``, ``bwd = 2*fwd``, times the visible share when causal
  (``causal_attention.py``: about 1/2 for a long sequence); other ops ``c * numel`` with ``c`` from
  ``_FLOPS_PER_ELEMENT`` (elementwise: 1 forward, 2 backward).
- Bytes: every non-view kernel dispatched reads its tensor inputs and writes its outputs
  (``_KernelCounter``); gathers (embedding, index_select) read output-sized rows only.
- Kernels: the number of non-view kernels dispatched (each pays ``kernel_overhead``).
- Matmuls (mm, addmm, bmm, baddbmm): their FLOPs by smallest dimension ``min(m, n, k)``, since a
  skinny matmul (few tokens, small head dim) runs far below peak.

Time per phase (``devices.DeviceSpec``)::

    compute = sum_i mm_flops_i / (peak[dtype] * matmul_eff(min_dim_i))
              + other_flops / (peak[dtype] * e),   e = attention_eff(keys a query sees) for fused attention,
                                                       compute_efficiency otherwise
    t = max(compute, bytes / (memory_bandwidth * memory_efficiency)) + kernels * kernel_overhead

A program run through torch.compile (``compile=True``) has every op's ``t`` (kernel overheads
included) multiplied by ``device.compute_scale`` = ``1 / compiled_speedup``
(``DeviceSpec.with_compile``): one measured factor for fusion, fewer launches and inductor's kernels.

Backward work counts only gradients that are needed: an input needs a gradient when it
is a parameter (``requires_grad`` in its ``meta["val"]``) or depends on one.
"""
from __future__ import annotations

import dataclasses
import math
import operator
import weakref
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from autopar.core.quiet_logs import quiet_fake_tensor_logs
from autopar.graph.grads import grad_nodes
from autopar.graph.grads import is_float_value as _is_float
from autopar.graph.grads import node_value as _val

from .causal_attention import causal_scale
from .devices import DeviceSpec
from .fused_attention import costs_fused, fused_sdpa_numbers
from .moe import is_moe, moe_work_numbers

aten = torch.ops.aten


@dataclass(frozen=True)
class OpWork:
    """Device-independent work of one op: FLOPs, bytes moved, kernels launched."""

    flops_fwd: float = 0.0
    flops_bwd: float = 0.0
    bytes_fwd: float = 0.0
    bytes_bwd: float = 0.0
    kernels_fwd: int = 0
    kernels_bwd: int = 0
    matmuls_fwd: tuple[tuple[int, float], ...] = ()  # (smallest dimension, FLOPs) per matmul size
    matmuls_bwd: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class OpCost:
    """Cost of one op on one device; ``time_*`` include ``launch_*`` (kernel overheads)."""

    flops_fwd: float
    flops_bwd: float
    bytes_fwd: float
    bytes_bwd: float
    time_fwd: float
    time_bwd: float
    launch_fwd: float = 0.0
    launch_bwd: float = 0.0

    @property
    def time_total(self) -> float:
        """Seconds, forward + backward."""
        return self.time_fwd + self.time_bwd

    @property
    def flops_total(self) -> float:
        return self.flops_fwd + self.flops_bwd

    @property
    def bytes_total(self) -> float:
        return self.bytes_fwd + self.bytes_bwd

    def scaled(self, factor: float) -> "OpCost":
        """The cost on one of ``factor`` shards: work / factor, same kernel launches.

        ``time' = (time - launch) / factor + launch``.
        """
        if factor <= 0:
            raise ValueError(f"shard factor must be > 0, got {factor}")
        return OpCost(
            self.flops_fwd / factor,
            self.flops_bwd / factor,
            self.bytes_fwd / factor,
            self.bytes_bwd / factor,
            (self.time_fwd - self.launch_fwd) / factor + self.launch_fwd,
            (self.time_bwd - self.launch_bwd) / factor + self.launch_bwd,
            self.launch_fwd,
            self.launch_bwd,
        )

    def __add__(self, other: "OpCost") -> "OpCost":
        return OpCost(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


ZERO_COST = OpCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)

_NO_KERNEL = {
    aten._unsafe_view.default,
    aten.detach.default,
    aten.alias.default,
    aten.lift_fresh.default,
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.empty_strided.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.sym_size.int,
    aten.sym_stride.int,
    aten.sym_numel.default,
    aten._assert_tensor_metadata.default,
}
# ops whose schema may return their input (an alias) but that copy when the dtype changes or the
# input is not contiguous: under mixed precision ``x.to(torch.float32)`` of a bf16 activation is a kernel
_MAYBE_COPY = {aten.to.dtype, aten.to.dtype_layout, aten.to.other, aten.contiguous.default}
_GATHERS = {aten.embedding.default, aten.index_select.default, aten.gather.default, aten.index.Tensor}
_NORMS = {
    aten.layer_norm.default,
    aten.native_layer_norm.default,
    aten.group_norm.default,
    aten.batch_norm.default,
    aten._native_batch_norm_legit_functional.default,
    aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit_no_training.default,
    aten.native_batch_norm.default,
    aten.rms_norm.default,
}
_SOFTMAX = {aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default}
_LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_forward.default}
_SDPA = {
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
}

# FLOPs per element (forward, backward-per-needed-gradient), used when FlopCounterMode has
# no entry; the element count is the largest tensor the op reads or writes.
_FLOPS_PER_ELEMENT: dict[object, tuple[float, float]] = {
    **{op: (5.0, 8.0) for op in _NORMS},
    **{op: (5.0, 4.0) for op in _SOFTMAX},
    **{op: (6.0, 4.0) for op in _LOSSES},
    aten.embedding.default: (0.0, 1.0),
    aten.index_select.default: (0.0, 1.0),
}
_ELEMENTWISE = (1.0, 2.0)


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches: expanded (stride-0) dimensions count once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= int(size)
    return n * t.element_size()


_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


def _matmul_shape(func, args) -> tuple[int, float] | None:
    """(smallest of m, n, k; FLOPs ``2*b*m*n*k``) of an mm/addmm/bmm/baddbmm call."""
    a, b = (args[1], args[2]) if func in (aten.addmm.default, aten.baddbmm.default) else (args[0], args[1])
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() < 2 or b.dim() < 2:
        return None
    m, k, n = int(a.shape[-2]), int(a.shape[-1]), int(b.shape[-1])
    batch = int(a.shape[0]) if a.dim() == 3 else 1
    return max(min(m, n, k), 1), 2.0 * batch * m * n * k


class _KernelCounter(TorchDispatchMode):
    """Counts non-view kernels and the bytes they read (inputs) and write (outputs), and
    the FLOPs of matmuls by smallest dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0
        self.bytes = 0
        self.matmuls: dict[int, float] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or func in _NO_KERNEL or func.namespace == "prim":
            return out
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if func in _GATHERS and ins:
            ins = ins[1:]  # the source table: only output-sized rows are read
            self.bytes += sum(_nbytes(t) for t in outs)
        if func in _MATMULS:
            shape = _matmul_shape(func, args)
            if shape is not None:
                self.matmuls[shape[0]] = self.matmuls.get(shape[0], 0.0) + shape[1]
        self.kernels += 1
        self.bytes += sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs)
        return out

    def matmul_table(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted(self.matmuls.items()))


# ---- running an op on fake tensors ----------------------------------------------------


def _tensor_sig(v: torch.Tensor, rg: bool):
    shape = tuple(int(s) for s in v.shape)
    stride = tuple(int(s) for s in v.stride())
    return ("T", shape, stride, v.dtype, rg and _is_float(v))


def _freeze(x):
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(i) for i in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    if isinstance(x, (torch.dtype, torch.device, torch.memory_format, torch.layout, int, float, bool, str, type(None))):
        return x
    return repr(x)


def work_signature(node: fx.Node, need: frozenset):
    """Hashable signature of a node's call: arguments with tensors as (shape, stride, dtype, needs grad)."""
    def sig(a):
        if isinstance(a, fx.Node):
            v = _val(a)
            if isinstance(v, torch.Tensor):
                return _tensor_sig(v, a in need)
            return ("V", _freeze(v))
        return a

    args = tree_map(sig, (node.args, node.kwargs))
    return _freeze(args)


def _materialize(sig_args):
    """Rebuild (args, kwargs) with fresh fake tensors (inside an active FakeTensorMode)."""
    leaves: list[torch.Tensor] = []

    def build(a):
        if isinstance(a, tuple) and a and a[0] == "T":
            _, shape, stride, dtype, rg = a
            t = torch.empty_strided(shape, stride, dtype=dtype)
            if rg:
                t.requires_grad_(True)
                leaves.append(t)
            return t
        if isinstance(a, tuple) and a and a[0] == "V":
            return a[1]
        if isinstance(a, tuple):
            return [build(i) for i in a]
        return a

    args, kwargs = sig_args
    return [build(a) for a in args], {k: build(v) for k, v in kwargs}, leaves


def _sdpa_flops(args) -> tuple[float, float]:
    q, k, v = args[:3]
    batch = 1
    for s in q.shape[:-2]:
        batch *= int(s)
    sq, d = int(q.shape[-2]), int(q.shape[-1])
    sk, dv = int(k.shape[-2]), int(v.shape[-1])
    fwd = 2.0 * batch * sq * sk * d + 2.0 * batch * sq * sk * dv
    return fwd, 2.0 * fwd


def _largest_numel(tensors) -> int:
    return max((t.numel() for t in tensors if isinstance(t, torch.Tensor)), default=0)


@lru_cache(maxsize=8192)
def _work(target, sig) -> OpWork:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with quiet_fake_tensor_logs(), FakeTensorMode(allow_non_fake_inputs=True):
        args, kwargs, leaves = _materialize(sig)
        counter, flops = _KernelCounter(), FlopCounterMode(display=False)
        with flops, counter:
            out = target(*args, **kwargs)
        fwd = (flops.get_total_flops(), counter.bytes, counter.kernels)
        mm_fwd, mm_bwd = counter.matmul_table(), ()
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        bwd = (0, 0, 0)
        if outs and leaves:
            seeds = [torch.ones_like(t) for t in outs]
            counter, flops = _KernelCounter(), FlopCounterMode(display=False)
            with flops, counter:
                torch.autograd.grad(outs, leaves, seeds, allow_unused=True)
            bwd = (flops.get_total_flops(), counter.bytes, counter.kernels)
            mm_bwd = counter.matmul_table()
        f_fwd, f_bwd = float(fwd[0]), float(bwd[0])
        if f_fwd == 0 and fwd[2] > 0:
            if target in _SDPA:
                f_fwd, sdpa_bwd = _sdpa_flops(args)
                f_bwd = sdpa_bwd if outs and leaves else 0.0
            else:
                per_fwd, per_bwd = _FLOPS_PER_ELEMENT.get(target, _ELEMENTWISE)
                out_tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
                numel = _largest_numel(out_tensors if target in _GATHERS else tensors + out_tensors)
                f_fwd = per_fwd * numel
                f_bwd = per_bwd * numel if bwd[2] > 0 else 0.0
        return OpWork(f_fwd, f_bwd, float(fwd[1]), float(bwd[1]), fwd[2], bwd[2], mm_fwd, mm_bwd)


_ZERO_TARGETS = {operator.getitem}


def node_work(node: fx.Node) -> OpWork:
    """FLOPs, bytes and kernels of one node, forward and backward (cached per signature)."""
    if node.op != "call_function" or node.target in _ZERO_TARGETS:
        return OpWork()
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return OpWork()
    if (target.is_view and not _copies(node)) or target in _NO_KERNEL:
        return OpWork()
    if is_moe(node):         # its fake kernel does no work: the formula of cost_models/moe.py
        return OpWork(**moe_work_numbers(node))
    need = grad_nodes(node.graph)
    try:
        work = _work(target, node_signature(node))
    except Exception:
        return _fallback_work(node, need)
    return _causal(work, causal_scale(node)) if target in _SDPA else work


def _copies(node: fx.Node) -> bool:
    """Whether a may-alias op (``_MAYBE_COPY``) runs a copy kernel here: its output's dtype differs from
    its input's, or (``contiguous``) its input is not contiguous."""
    if node.target not in _MAYBE_COPY or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    src, out = _val(node.args[0]), _val(node)
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    if node.target == aten.contiguous.default:
        return not src.is_contiguous()
    return src.dtype != out.dtype


def _causal(work: OpWork, f: float) -> OpWork:
    """``work`` with its FLOPs at the share ``f`` of the score entries a causal mask leaves visible
    (``causal_attention.py``; bytes and kernels as they are)."""
    if f >= 1.0:
        return work
    return dataclasses.replace(work, flops_fwd=work.flops_fwd * f, flops_bwd=work.flops_bwd * f,
                               matmuls_fwd=tuple((d, fl * f) for d, fl in work.matmuls_fwd),
                               matmuls_bwd=tuple((d, fl * f) for d, fl in work.matmuls_bwd))


def node_signature(node: fx.Node):
    """``work_signature(node, grad_nodes(node.graph))``, cached per node while the values of the
    node and its inputs stay the same objects (building it walks every argument: it was the
    largest single cost of planning a 48-layer model)."""
    vals = (node.meta.get("val"), *(a.meta.get("val") for a in node.all_input_nodes))
    hit = _SIGNATURES.get(node)
    if hit is not None and len(hit[0]) == len(vals) and all(x is y for x, y in zip(hit[0], vals)):
        return hit[1]
    sig = work_signature(node, grad_nodes(node.graph))
    _SIGNATURES[node] = (vals, sig)
    return sig


_SIGNATURES: "weakref.WeakKeyDictionary[fx.Node, tuple]" = weakref.WeakKeyDictionary()


def _fallback_work(node: fx.Node, need: frozenset) -> OpWork:
    """When an op cannot run on fake tensors: elementwise estimate from the metadata."""
    ins = [_val(a) for a in node.all_input_nodes if isinstance(_val(a), torch.Tensor)]
    outs = [t for t in tree_flatten(_val(node))[0] if isinstance(t, torch.Tensor)]
    numel = _largest_numel(ins + outs)
    moved = float(sum(_nbytes(t) for t in ins + outs))
    has_bwd = node in need
    per_fwd, per_bwd = _FLOPS_PER_ELEMENT.get(node.target, _ELEMENTWISE)
    return OpWork(
        per_fwd * numel,
        per_bwd * numel if has_bwd else 0.0,
        moved,
        2 * moved if has_bwd else 0.0,
        1,
        1 if has_bwd else 0,
    )


def _dtype(node: fx.Node) -> torch.dtype:
    for v in tree_flatten(_val(node))[0] + [_val(a) for a in node.all_input_nodes]:
        if _is_float(v):
            return v.dtype
    return torch.float32


def roofline_time(
    flops: float,
    nbytes: float,
    kernels: int,
    device: DeviceSpec,
    dtype: torch.dtype,
    matmuls: tuple[tuple[int, float], ...] = (),
    efficiency: float | None = None,
) -> float:
    """``max(compute, bytes / (bw * mem_eff)) + kernels * kernel_overhead`` with ``compute`` =
    each matmul's FLOPs at ``matmul_eff(min_dim)`` plus the other FLOPs at ``efficiency``
    (default ``compute_efficiency``)."""
    if kernels == 0 and flops == 0 and nbytes == 0:
        return 0.0
    peak = device.flops_per_s(dtype)
    compute = sum(f / (peak * device.matmul_eff(d)) for d, f in matmuls)
    compute += max(flops - sum(f for _, f in matmuls), 0.0) / (peak * (efficiency or device.compute_efficiency))
    memory = nbytes / (device.memory_bandwidth * device.memory_efficiency)
    return max(compute, memory) + kernels * device.kernel_overhead


def cost_from_work(work: OpWork, device: DeviceSpec, dtype: torch.dtype = torch.float32,
                   attention: bool = False, keys_per_query: float = 0.0) -> OpCost:
    """Roofline an :class:`OpWork` on ``device`` (times ``device.compute_scale``); ``attention``: a fused
    attention kernel, whose FLOPs run at ``device.attention_eff(keys_per_query)``."""
    eff = device.attention_eff(keys_per_query) if attention else None
    k = device.compute_scale
    lf = work.kernels_fwd * device.kernel_overhead * k
    lb = work.kernels_bwd * device.kernel_overhead * k
    return OpCost(
        work.flops_fwd,
        work.flops_bwd,
        work.bytes_fwd,
        work.bytes_bwd,
        k * roofline_time(work.flops_fwd, work.bytes_fwd, work.kernels_fwd, device, dtype, work.matmuls_fwd, eff),
        k * roofline_time(work.flops_bwd, work.bytes_bwd, work.kernels_bwd, device, dtype, work.matmuls_bwd, eff),
        lf,
        lb,
    )


def _mm_dims(target, shapes: list) -> tuple[int, int, int, int] | None:
    """(batch, m, n, k) of a matmul op on operands of ``shapes`` (None when not a matmul)."""
    if target in (aten.addmm.default, aten.baddbmm.default):
        shapes = shapes[1:]
    if len(shapes) < 2 or len(shapes[0]) < 2 or len(shapes[1]) < 1:
        return None
    a, b = shapes[0], shapes[1]
    if target == aten.linear.default:        # x[..., k] @ w[n, k].T
        return 1, math.prod(a[:-1]), int(b[0]), int(a[-1])
    if len(b) < 2:
        return None
    batch = math.prod(torch.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2]))) if len(a) > 2 or len(b) > 2 else 1
    return int(batch), int(a[-2]), int(b[-1]), int(a[-1])


_LOCAL_COSTED = {aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default,
                 aten.baddbmm.default, aten.matmul.default}


def local_node_cost(node: fx.Node, input_shapes: dict, device: DeviceSpec) -> OpCost | None:
    """Cost of a matmul node run on local pieces (``input_shapes``: input node -> local shape),
    so that a sharded matmul pays the efficiency of its own smallest dimension (4 data-parallel
    ranks give each a quarter of the tokens): the node's work divided by
    ``f = b m n k / (b' m' n' k')``, its matmuls at ``min(m', n', k')``, its kernels as they are.
    None for other nodes."""
    if node.target not in _LOCAL_COSTED:
        return None
    ins = [a for a in node.args if isinstance(a, fx.Node)]
    try:
        full = _mm_dims(node.target, [tuple(_val(a).shape) for a in ins])
        local = _mm_dims(node.target, [tuple(input_shapes.get(a, _val(a).shape)) for a in ins])
    except (AttributeError, RuntimeError, TypeError):
        return None
    if full is None or local is None or min(local) <= 0:
        return None
    f = math.prod(full) / math.prod(local)
    work = node_work(node)
    d = min(local[1:])

    def regroup(table):
        return ((d, sum(fl for _, fl in table) / f),) if table else ()

    scaled = OpWork(work.flops_fwd / f, work.flops_bwd / f, work.bytes_fwd / f, work.bytes_bwd / f,
                    work.kernels_fwd, work.kernels_bwd, regroup(work.matmuls_fwd), regroup(work.matmuls_bwd))
    return cost_from_work(scaled, device, _dtype(node))


def node_cost(node: fx.Node, device: DeviceSpec) -> OpCost:
    """Forward and backward cost of one node on ``device`` (0 for inputs, outputs and views that no two
    gradient-needing ops consume), with the backward's sum of the node's gradients (``grad_sum_work``)."""
    work = node_work(node)
    summed = grad_sum_work(node)
    if summed is not None:
        work = OpWork(work.flops_fwd, work.flops_bwd + summed.flops_bwd, work.bytes_fwd, work.bytes_bwd + summed.bytes_bwd,
                      work.kernels_fwd, work.kernels_bwd + summed.kernels_bwd, work.matmuls_fwd, work.matmuls_bwd)
    if work == OpWork():
        return ZERO_COST
    if node.target in _SDPA and work.kernels_fwd > 1 and costs_fused(device) and \
            (fused := fused_sdpa_numbers(node, work.kernels_bwd > 0, causal_scale(node))) is not None:
        work = OpWork(**fused)      # unequal head dims (MLA): CUDA's fused kernels take them (fused_attention.py)
    if node.target not in _SDPA:
        return cost_from_work(work, device, _dtype(node))
    return cost_from_work(work, device, _dtype(node), attention=True, keys_per_query=_keys_per_query(node))


def grad_sum_work(node: fx.Node) -> OpWork | None:
    """The backward's additions of a value's gradients: autograd sums the gradients of a tensor that ``k``
    gradient-needing ops consume (a residual stream read by a norm and an add; one input of the q, k and v
    projections) with ``k - 1`` elementwise adds, each reading two gradients and writing one. None when
    the node is not a call producing one tensor that needs a gradient, or fewer than two such ops read it."""
    if node.op != "call_function":
        return None
    val = _val(node)
    if not isinstance(val, torch.Tensor) or not _is_float(val):
        return None
    need = grad_nodes(node.graph)
    if node not in need:
        return None
    k = sum(1 for u in node.users if u.op == "call_function" and u in need)
    if k < 2:
        return None
    n = val.numel()
    return OpWork(0.0, float((k - 1) * n), 0.0, float(3 * (k - 1) * n * val.element_size()), 0, k - 1)


def _keys_per_query(node: fx.Node) -> float:
    """Keys an attention node's query sees on average: its key length times the causal share (0 when
    the shapes are unknown)."""
    try:
        sk = int(node.args[1].meta["val"].shape[-2])
    except (AttributeError, KeyError, IndexError, TypeError):
        return 0.0
    return sk * causal_scale(node)


def graph_cost(gm: fx.GraphModule | fx.Graph, device: DeviceSpec) -> dict[str, OpCost]:
    """Node name -> :class:`OpCost` for every node of the graph."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    return {node.name: node_cost(node, device) for node in graph.nodes}


def total_flops(gm: fx.GraphModule | fx.Graph) -> float:
    """FLOPs of one training iteration (forward + backward, no recomputation)."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    total = 0.0
    for node in graph.nodes:
        w = node_work(node)
        total += w.flops_fwd + w.flops_bwd
    return total


def total_cost(gm: fx.GraphModule | fx.Graph, device: DeviceSpec) -> OpCost:
    """Sum of :func:`graph_cost` over all nodes."""
    total = ZERO_COST
    for cost in graph_cost(gm, device).values():
        total = total + cost
    return total
