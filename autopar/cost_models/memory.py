"""Memory: parameters, gradients, optimizer states, and activations with liveness.

Per parameter (bytes), ``training_state_bytes_per_param``::

    precision   weights  grads  fp32 master  states (sgd / sgd_momentum / adam(w))
    fp32        4        4      0            0 / 4 / 8        -> adam: 16
    bf16|fp16   2        2      4            0 / 4 / 8        -> adam: 16 (bf16 weights and grads)
    mixed       2        4      4            0 / 4 / 8        -> adam: 18 (autopar's mixed_precision="bf16":
                                                                 fp32 master + fp32 grad, bf16 working copy)

Activations saved for backward come from a registry ``{aten op: rule(node) -> [saved]}``
(``SAVE_RULES``); a saved item is a graph node (its whole storage is kept: views of one
base count once) or an :class:`Internal` tensor the op makes itself (a dropout mask, the
layer-norm statistics, a contiguous copy). Ops without a rule save every tensor input
(conservative). Nodes that need no gradient save nothing, parameters are not activations.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

from .compute import grad_nodes, is_parameter

aten = torch.ops.aten

# ---- parameters, gradients, optimizer states ------------------------------------------

_STATE_BYTES = {"sgd": 0, "sgd_momentum": 4, "adam": 8, "adamw": 8}
_WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "mixed": 2}
_GRAD_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "mixed": 4}


def _check(optimizer: str, precision: str) -> tuple[str, str]:
    opt, prec = optimizer.lower(), precision.lower()
    if opt not in _STATE_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(_STATE_BYTES)}")
    if prec not in _WEIGHT_BYTES:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(_WEIGHT_BYTES)}")
    return opt, prec


def weight_bytes_per_param(precision: str = "fp32") -> int:
    """Bytes of one weight (and of one gradient) in ``precision``."""
    return _WEIGHT_BYTES[_check("sgd", precision)[1]]


def optimizer_state_bytes(numel: int, optimizer: str = "adamw", precision: str = "fp32") -> int:
    """Optimizer memory for ``numel`` parameters: states (fp32) + fp32 master weights when
    the weights are in half precision."""
    opt, prec = _check(optimizer, precision)
    master = 4 if prec != "fp32" else 0
    return numel * (_STATE_BYTES[opt] + master)


def training_state_bytes_per_param(optimizer: str = "adamw", precision: str = "fp32") -> int:
    """Weights + gradients + optimizer memory per parameter (Adam: fp32 16, mixed precision 18)."""
    prec = _check(optimizer, precision)[1]
    return _WEIGHT_BYTES[prec] + _GRAD_BYTES[prec] + optimizer_state_bytes(1, optimizer, precision)


def training_state_parts(numel: float, dtype: torch.dtype | None, optimizer: str = "adamw",
                         precision: str = "fp32") -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes of ``numel`` parameters stored as ``dtype``:
    the parts of :func:`training_state_bytes` (the optimizer part holds fp32 masters under mixed
    precision), which ZeRO shards one stage at a time."""
    opt, prec = _check(optimizer, precision)
    if prec == "fp32" and dtype is not None and dtype.is_floating_point and dtype != torch.float32:
        size = torch.empty((), dtype=dtype).element_size()
        return numel * size, numel * size, numel * size * (_STATE_BYTES[opt] // 4)
    return numel * _WEIGHT_BYTES[prec], numel * _GRAD_BYTES[prec], float(optimizer_state_bytes(numel, optimizer,
                                                                                                precision))


def training_state_bytes(numel: float, dtype: torch.dtype | None, optimizer: str = "adamw",
                         precision: str = "fp32") -> float:
    """Weights + gradients + optimizer states of ``numel`` parameters stored as ``dtype``.

    ``precision`` "fp32" means no mixed precision: the model trains in its own dtype, so a
    bf16/fp16 model keeps bf16 weights, bf16 gradients and AdamW moments of the parameter's dtype
    (``torch.zeros_like(p)``): ``numel * size * (2 + states)`` (AdamW bf16: 8 bytes, not 16).
    Mixed precision ("bf16"/"fp16"/"mixed") keeps fp32 masters and fp32 states:
    :func:`training_state_bytes_per_param`."""
    return sum(training_state_parts(numel, dtype, optimizer, precision))


def _graph(gm: fx.GraphModule | fx.Graph) -> fx.Graph:
    return gm.graph if isinstance(gm, fx.GraphModule) else gm


def parameter_nodes(gm: fx.GraphModule | fx.Graph) -> list[fx.Node]:
    """The graph inputs that are trainable parameters (one node per distinct storage)."""
    seen, out = set(), []
    for node in _graph(gm).nodes:
        if node.op in ("placeholder", "get_attr") and is_parameter(node):
            key = _storage(node)[0]
            if key not in seen:
                seen.add(key)
                out.append(node)
    return out


def param_numel(gm: fx.GraphModule | fx.Graph) -> int:
    """Number of trainable parameters (tied weights once)."""
    return sum(node.meta["val"].numel() for node in parameter_nodes(gm))


def param_bytes(gm: fx.GraphModule | fx.Graph, precision: str | None = None) -> int:
    """Parameter bytes: as traced, or ``numel * weight_bytes_per_param(precision)``."""
    if precision is not None:
        return param_numel(gm) * weight_bytes_per_param(precision)
    return sum(_tensor_bytes(node.meta["val"]) for node in parameter_nodes(gm))


# ---- what each op saves for backward --------------------------------------------------


@dataclass(frozen=True)
class Internal:
    """A tensor an op creates and saves for backward (not a graph node)."""

    label: str
    nbytes: int


Saved = "fx.Node | Internal"
SaveRule = Callable[[fx.Node], list]
SAVE_RULES: dict[object, SaveRule] = {}


def saves(*ops) -> Callable[[SaveRule], SaveRule]:
    """Register ``rule(node) -> list[fx.Node | Internal]`` for ``ops``."""

    def register(rule: SaveRule) -> SaveRule:
        for op in ops:
            SAVE_RULES[op] = rule
        return rule

    return register


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if isinstance(_val(a), torch.Tensor)]


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _out(node: fx.Node, index: int = 0) -> torch.Tensor:
    val = _val(node)
    return val[index] if isinstance(val, (tuple, list)) else val


def _batched_view_or_copy(node: fx.Node, t: fx.Node, label: str) -> list:
    """A matmul operand: saved as is when folding it to 2-D/3-D is a view, else its copy."""
    val = _val(t)
    if val.dim() <= 2:
        return [t]
    meta = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
    folded = meta.reshape(-1, *val.shape[-2:])
    if folded._base is not None:
        return [t]
    return [Internal(f"{node.name}.{label}", _tensor_bytes(val))]


@saves(aten.linear.default)
def _linear(node):
    x, w = node.args[0], node.args[1]
    need = grad_nodes(node.graph)
    out = _batched_view_or_copy(node, x, "input") if w in need else []
    return out + ([w] if x in need else [])


@saves(aten.matmul.default, aten.mm.default, aten.bmm.default)
def _matmul(node):
    a, b = node.args[0], node.args[1]
    need = grad_nodes(node.graph)
    out = _batched_view_or_copy(node, a, "a") if b in need else []
    return out + (_batched_view_or_copy(node, b, "b") if a in need else [])


@saves(aten.addmm.default, aten.baddbmm.default)
def _addmm(node):
    return [node.args[1], node.args[2]]


@saves(aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default)
def _conv(node):
    return [node.args[0], node.args[1]]


def _stats(node: fx.Node, count: int, label: str) -> Internal:
    """Per-row statistics (mean, rstd) kept in fp32 (fp64 for fp64 inputs)."""
    width = 8 if _val(node).dtype == torch.float64 else 4
    return Internal(f"{node.name}.{label}", 2 * count * width)


@saves(aten.layer_norm.default, aten.native_layer_norm.default)
def _layer_norm(node):
    x = _val(node.args[0])
    normalized = math.prod(node.args[1])
    return [node.args[0], _stats(node, x.numel() // max(normalized, 1), "mean_rstd")]


@saves(aten.rms_norm.default)
def _rms_norm(node):
    x = _val(node.args[0])
    normalized = math.prod(node.args[1])
    return [node.args[0], Internal(f"{node.name}.rstd", x.numel() // max(normalized, 1) * 4)]


@saves(aten.group_norm.default)
def _group_norm(node):
    x = _val(node.args[0])
    return [node.args[0], _stats(node, x.shape[0] * node.args[1], "mean_rstd")]


@saves(
    aten.batch_norm.default,
    aten._native_batch_norm_legit_functional.default,
    aten._native_batch_norm_legit.default,
    aten.native_batch_norm.default,
)
def _batch_norm(node):
    x = _val(node.args[0])
    if not node.args[5]:  # training flag: argument 5 of every variant registered here
        return [node.args[0]]
    return [node.args[0], _stats(node, x.shape[1], "mean_invstd")]


@saves(
    aten.relu.default,
    aten.relu_.default,
    aten.sigmoid.default,
    aten.tanh.default,
    aten.exp.default,
    aten.sqrt.default,
    aten.rsqrt.default,
    aten.softmax.int,
    aten._softmax.default,
    aten.log_softmax.int,
    aten._log_softmax.default,
)
def _saves_output(node):
    return [node]


@saves(
    aten.gelu.default,
    aten.silu.default,
    aten.leaky_relu.default,
    aten.elu.default,
    aten.mish.default,
    aten.hardswish.default,
    aten.log.default,
    aten.sin.default,
    aten.cos.default,
    aten.pow.Tensor_Scalar,
    aten.abs.default,
)
def _saves_input(node):
    return [node.args[0]]


def dropout_rule(mask_bytes: int | None) -> SaveRule:
    """Dropout keeps its mask: ``mask_bytes`` per element (1: the bool mask of the fused
    GPU kernel), or the input's element size when None (CPU eager computes
    ``input * noise`` with a noise tensor of the input's dtype). p = 0 or eval: nothing."""

    def rule(node):
        p, train = _arg(node, 1, "p", 0.5), _arg(node, 2, "train", True)
        if not train or p == 0:
            return []
        x = _val(node.args[0])
        per = x.element_size() if mask_bytes is None else mask_bytes
        return [Internal(f"{node.name}.mask", x.numel() * per)]

    return rule


@saves(aten.native_dropout.default)
def _native_dropout(node):
    x = _val(node.args[0])
    return [Internal(f"{node.name}.mask", x.numel())]


def _binary(node: fx.Node, save_a_if_b: bool, save_b_if_a: bool, save_b_if_b: bool) -> list:
    a, b = node.args[0], node.args[1]
    need = grad_nodes(node.graph)
    a_rg = isinstance(a, fx.Node) and a in need
    b_rg = isinstance(b, fx.Node) and b in need
    out = []
    if isinstance(a, fx.Node) and save_a_if_b and b_rg:
        out.append(a)
    if isinstance(b, fx.Node) and ((save_b_if_a and a_rg) or (save_b_if_b and b_rg)):
        out.append(b)
    return out


@saves(aten.mul.Tensor)
def _mul(node):
    """``d(a*b)/da = b``, ``d(a*b)/db = a``."""
    return _binary(node, save_a_if_b=True, save_b_if_a=True, save_b_if_b=False)


@saves(aten.div.Tensor)
def _div(node):
    """``d(a/b)/da = 1/b``, ``d(a/b)/db = -a/b^2``."""
    return _binary(node, save_a_if_b=True, save_b_if_a=True, save_b_if_b=True)


@saves(aten.embedding.default)
def _embedding(node):
    return [node.args[1]]


@saves(aten.cross_entropy_loss.default)
def _cross_entropy(node):
    """log_softmax keeps its output (input-sized), nll_loss keeps the target."""
    x = _val(node.args[0])
    return [Internal(f"{node.name}.log_probs", _tensor_bytes(x)), node.args[1]]


@saves(aten.nll_loss.default, aten.nll_loss_forward.default)
def _nll(node):
    return [node.args[1]]


@saves(
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
)
def _sdpa(node):
    """q, k, v, the output and the fp32 logsumexp (batch x heads x Sq)."""
    q = _val(node.args[0])
    lse = Internal(f"{node.name}.logsumexp", math.prod(q.shape[:-1]) * 4)
    mask = _arg(node, 3, "attn_mask")
    extra = [mask] if isinstance(mask, fx.Node) else []
    return [node.args[0], node.args[1], node.args[2], node, lse] + extra


@saves(aten.max_pool1d.default, aten.max_pool2d.default, aten.max_pool3d.default)
def _max_pool(node):
    """Input and int64 indices of the output's size."""
    return [node.args[0], Internal(f"{node.name}.indices", _out(node).numel() * 8)]


@saves(aten.avg_pool1d.default, aten.avg_pool2d.default, aten.avg_pool3d.default)
def _avg_pool(node):
    return [node.args[0]]


@saves(aten.adaptive_avg_pool1d.default, aten.adaptive_avg_pool2d.default, aten.adaptive_avg_pool3d.default)
def _adaptive_avg_pool(node):
    """Output size 1 runs as ``mean`` (saves nothing); otherwise the input is kept."""
    size = node.args[1]
    size = [size] if isinstance(size, int) else list(size)
    return [] if all(s == 1 for s in size) else [node.args[0]]


@saves(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def _masked_fill(node):
    return [node.args[1]]


@saves(aten.where.self)
def _where(node):
    return [node.args[0]]


_SAVES_NOTHING = [
    aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.neg.default, aten.rsub.Scalar,
    aten.add.Scalar, aten.sub.Scalar, aten.mul.Scalar, aten.div.Scalar,
    aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim,
    aten.cat.default, aten.stack.default, aten.clone.default, aten.contiguous.default,
    aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.type_as.default,
    aten.expand.default, aten.repeat.default, aten.pad.default, aten.constant_pad_nd.default,
    aten.flatten.using_ints, aten.unflatten.int, aten.reshape.default, aten.view.default,
    aten.transpose.int, aten.permute.default, aten.t.default, aten.squeeze.dim,
    aten.unsqueeze.default, aten.split.Tensor, aten.chunk.default, aten.unbind.int,
    aten.slice.Tensor, aten.select.int, aten.narrow.default, aten.roll.default,
    aten.tril.default, aten.triu.default,
]
for _op in _SAVES_NOTHING:
    SAVE_RULES.setdefault(_op, lambda node: [])
SAVE_RULES[aten.dropout.default] = dropout_rule(1)


def _default_rule(node: fx.Node) -> list:
    """Unknown op: every tensor input (conservative)."""
    return _tensor_args(node)


def _storage(node: fx.Node) -> tuple[object, int]:
    """(key, bytes) of the storage behind a node's value: views of one base share it."""
    val = _val(node)
    if isinstance(val, torch.Tensor):
        try:
            storage = val.untyped_storage()
            return StorageWeakRef(storage), int(storage.nbytes())
        except (NotImplementedError, RuntimeError):
            return ("node", node.name), _tensor_bytes(val)
    size = sum(_tensor_bytes(t) for t in tree_flatten(val)[0] if isinstance(t, torch.Tensor))
    return ("node", node.name), size


def storage_key(node: fx.Node) -> object:
    """A key equal for nodes whose values share one storage (views of one base)."""
    return _storage(node)[0]


def _saved_items(node: fx.Node, mask_bytes: int | None) -> list:
    if node.op != "call_function" or node not in grad_nodes(node.graph):
        return []
    if node.target is aten.dropout.default:
        rule = dropout_rule(mask_bytes)
    else:
        rule = SAVE_RULES.get(node.target, _default_rule)
    return [s for s in rule(node) if isinstance(s, Internal) or isinstance(_val(s), torch.Tensor)]


def saves_input(node: fx.Node, arg: fx.Node, dropout_mask_bytes: int | None = 1) -> bool:
    """Whether ``node`` keeps its input ``arg`` (as given to it) for backward."""
    return any(s is arg for s in _saved_items(node, dropout_mask_bytes))


def _param_keys(graph: fx.Graph) -> set:
    return {_storage(n)[0] for n in graph.nodes if n.op in ("placeholder", "get_attr") and is_parameter(n)}


def _saved_by_node(graph: fx.Graph, mask_bytes: int | None) -> dict[fx.Node, list[tuple[object, str, int]]]:
    """node -> [(storage key, name, bytes)] of what it saves (parameters dropped)."""
    params = _param_keys(graph)
    out: dict[fx.Node, list[tuple[object, str, int]]] = {}
    for node in graph.nodes:
        items = []
        for s in _saved_items(node, mask_bytes):
            if isinstance(s, Internal):
                items.append((("internal", s.label), s.label, s.nbytes))
            else:
                key, nbytes = _storage(s)
                if key not in params:
                    items.append((key, s.name, nbytes))
        if items:
            out[node] = items
    return out


def saved_activations(gm: fx.GraphModule | fx.Graph, dropout_mask_bytes: int | None = 1) -> dict[str, int]:
    """Tensors kept for backward at the end of the forward: name -> bytes, each storage once.

    A name is the first node whose storage it is (or an :class:`Internal` label).
    ``dropout_mask_bytes``: 1 (GPU bool mask, the default) or None (CPU eager, see
    :func:`dropout_rule`); :func:`dropout_mask_bytes_for` picks it from a device.
    """
    graph = _graph(gm)
    result: dict[str, int] = {}
    seen: set = set()
    for items in _saved_by_node(graph, dropout_mask_bytes).values():
        for key, name, nbytes in items:
            if key not in seen:
                seen.add(key)
                result[name] = nbytes
    return result


def saved_bytes_by_node(gm: fx.GraphModule | fx.Graph,
                        dropout_mask_bytes: int | None = 1) -> dict[str, tuple[int, int]]:
    """node name -> (bytes of saved graph storages charged to it, bytes of the tensors it makes
    and saves itself), each storage once: a graph storage is charged to the node named as in
    :func:`saved_activations` (so it splits like that node's output), an :class:`Internal`
    (log-probabilities of a cross-entropy, layer-norm statistics, attention logsumexp, dropout
    masks) to the op that creates it (it splits like that op's input)."""
    graph = _graph(gm)
    out: dict[str, list[int]] = {}
    seen: set = set()
    for node, items in _saved_by_node(graph, dropout_mask_bytes).items():
        for key, name, nbytes in items:
            if key in seen:
                continue
            seen.add(key)
            internal = isinstance(key, tuple) and key[:1] == ("internal",)
            owner = node.name if internal else name
            out.setdefault(owner, [0, 0])[1 if internal else 0] += nbytes
    return {k: (v[0], v[1]) for k, v in out.items()}


def dropout_mask_bytes_for(device_name: str) -> int | None:
    """Bytes per dropout-mask element on a device: CPU eager keeps a full-width mask."""
    return None if device_name == "cpu" else 1


# ---- liveness --------------------------------------------------------------------------


@dataclass(frozen=True)
class ActivationProfile:
    """Forward-pass activation memory: the peak, where it happens, what stays saved."""

    peak_bytes: int
    peak_node: str
    saved_bytes: int
    saved: dict[str, int] = field(default_factory=dict)
    max_grad_bytes: int = 0  # largest (output + input gradients) of one node in backward


def activation_peak_bytes(gm: fx.GraphModule | fx.Graph, dropout_mask_bytes: int | None = 1) -> ActivationProfile:
    """Walk the forward in order: a node's new storage becomes live when it runs and is
    freed after its last forward use unless saved for backward (or a graph output);
    internal saved tensors are live from their op to the end. Parameters are not counted,
    graph inputs are. ``peak = max over nodes of live bytes`` (outputs of a node and its
    inputs are live together)."""
    graph = _graph(gm)
    nodes = list(graph.nodes)
    params = _param_keys(graph)
    saved_by = _saved_by_node(graph, dropout_mask_bytes)
    keep = {key for items in saved_by.values() for key, _, _ in items}
    last_use: dict[object, int] = {}
    for i, node in enumerate(nodes):
        for arg in node.all_input_nodes:
            key = _storage(arg)[0]
            last_use[key] = max(last_use.get(key, -1), i)
        if node.op == "output":
            for arg in node.all_input_nodes:
                keep.add(_storage(arg)[0])
    live: dict[object, int] = {}
    peak, peak_node = 0, ""
    max_grad = 0
    for i, node in enumerate(nodes):
        if node.op == "output":
            break
        if node.op != "get_attr":
            key, nbytes = _storage(node)
            if key not in params and key not in live and nbytes > 0:
                live[key] = nbytes
        for key, _, nbytes in saved_by.get(node, []):
            live.setdefault(key, nbytes)
        total = sum(live.values())
        if total > peak:
            peak, peak_node = total, node.name
        if node.op == "call_function":
            grads = _storage(node)[1] + sum(_storage(a)[1] for a in node.all_input_nodes if _storage(a)[0] not in params)
            max_grad = max(max_grad, grads)
        for key in [k for k in live if last_use.get(k, -1) <= i and k not in keep]:
            del live[key]
    saved = saved_activations(graph, dropout_mask_bytes)
    return ActivationProfile(peak, peak_node, sum(saved.values()), saved, max_grad)


# ---- the whole picture ---------------------------------------------------------------


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes of one device during a training step, by kind."""

    params: int
    grads: int
    optimizer: int
    activations: int  # saved for backward (times in-flight microbatches)
    transient: int  # forward temporaries above the saved set, or backward gradients
    total: int


def peak_breakdown(
    gm: fx.GraphModule | fx.Graph,
    optimizer: str = "adamw",
    precision: str = "fp32",
    *,
    param_shard: float = 1,
    activation_shard: float = 1,
    inflight: int = 1,
    dropout_mask_bytes: int | None = 1,
) -> MemoryBreakdown:
    """``total = params + grads + optimizer + inflight * activations + transient``, with
    parameter-sized terms divided by ``param_shard`` and activation terms by
    ``activation_shard``; ``transient = max(forward peak - saved, max backward grads)``."""
    numel = param_numel(gm)
    weight = weight_bytes_per_param(precision)
    params = int(numel * weight / param_shard)
    grads = params
    opt = int(optimizer_state_bytes(numel, optimizer, precision) / param_shard)
    prof = activation_peak_bytes(gm, dropout_mask_bytes)
    acts = int(prof.saved_bytes * inflight / activation_shard)
    transient = int(max(prof.peak_bytes - prof.saved_bytes, prof.max_grad_bytes) / activation_shard)
    return MemoryBreakdown(params, grads, opt, acts, transient, params + grads + opt + acts + transient)


# ---- pipelines ---------------------------------------------------------------------


def inflight_microbatches(schedule: str, num_stages: int, stage: int, microbatches: int) -> int:
    """Microbatches whose activations a stage holds at its peak.

    GPipe: all ``m``. 1F1B (and interleaved, approximately): ``min(p - stage, m)``, so the
    first stage holds ``p``. No pipeline ("none"): 1.
    """
    kind = schedule.lower()
    if not 0 <= stage < max(num_stages, 1):
        raise ValueError(f"stage {stage} outside 0..{num_stages - 1}")
    if kind == "none":
        return 1
    if kind == "gpipe":
        return microbatches
    if kind in ("1f1b", "interleaved_1f1b", "interleaved"):
        return min(num_stages - stage, microbatches)
    raise ValueError(f"unknown schedule {schedule!r}; known: none, gpipe, 1f1b, interleaved_1f1b")


def iter_saved_storages(gm: fx.GraphModule | fx.Graph,
                        dropout_mask_bytes: int | None = 1) -> Iterable[tuple[str, object, int, bool]]:
    """(saving node, storage key, bytes, internal) for every tensor a node saves: the key is the
    same for every view of one storage (q, k, v split from one projection count once)."""
    for node, items in _saved_by_node(_graph(gm), dropout_mask_bytes).items():
        for key, _, nbytes in items:
            yield node.name, key, nbytes, isinstance(key, tuple) and key[:1] == ("internal",)


def iter_saved(gm: fx.GraphModule | fx.Graph, dropout_mask_bytes: int | None = 1) -> Iterable[tuple[str, str, int]]:
    """(node, saved tensor, bytes) for every node that saves something — a debug view."""
    for node, items in _saved_by_node(_graph(gm), dropout_mask_bytes).items():
        for _, name, nbytes in items:
            yield node.name, name, nbytes
