"""Memory: parameters, gradients, optimizer states, and activations with liveness.

Per parameter (bytes), ``training_state_bytes_per_param``::

    precision   weights  grads  fp32 master  states (sgd / sgd_momentum / adam(w))
    fp32        4        4      0            0 / 4 / 8        -> adam: 16
    bf16|fp16   2        2      4            0 / 4 / 8        -> adam: 16 (bf16 weights and grads)
    mixed       2        4      4            0 / 4 / 8        -> adam: 18 (autopar's mixed_precision="bf16":
                                                                 fp32 master + fp32 grad, bf16 working copy)

Activations saved for backward come from a registry ``{aten op: rule(node) -> [saved]}``
(``save_rules.SAVE_RULES``); a saved item is a graph node (its whole storage is kept: views of one
base count once) or an :class:`Internal` tensor the op makes itself (a dropout mask, the
layer-norm statistics, a contiguous copy). Ops without a rule save every tensor input
(conservative). Nodes that need no gradient save nothing, parameters are not activations.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

from autopar.core import search_memo
from autopar.graph.grads import grad_nodes, is_parameter
from .moe import is_moe, moe_save_rule
from .save_rules import SAVE_RULES, Internal, default_rule, dropout_rule, node_value, tensor_bytes

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
    return sum(tensor_bytes(node.meta["val"]) for node in parameter_nodes(gm))


def _storage(node: fx.Node) -> tuple[object, int]:
    """(key, bytes) of the storage behind a node's value: views of one base share it."""
    val = node_value(node)
    if isinstance(val, torch.Tensor):
        try:
            storage = val.untyped_storage()
            return StorageWeakRef(storage), int(storage.nbytes())
        except (NotImplementedError, RuntimeError):     # no storage to share (sparse, some subclasses):
            return ("node", node.name), tensor_bytes(val)  # the value counts alone, at its own size
    size = sum(tensor_bytes(t) for t in tree_flatten(val)[0] if isinstance(t, torch.Tensor))
    return ("node", node.name), size


def storage_key(node: fx.Node) -> object:
    """A key equal for nodes whose values share one storage (views of one base)."""
    return _storage(node)[0]


_SAVED_ITEMS: "weakref.WeakKeyDictionary[fx.Node, dict]" = weakref.WeakKeyDictionary()


def _saved_items(node: fx.Node, mask_bytes: int | None) -> list:
    """What ``node``'s save rule keeps (``_rule_items``), memoised per node and mask while what the
    rules read stays the same objects: the node's arguments, its and its inputs' values, and the
    graph's set of values that need a gradient (a planning search asks it for every edge of every solve)."""
    if not search_memo.ENABLED:
        return _rule_items(node, mask_bytes)
    need = grad_nodes(node.graph)
    guard = (node.args, node.kwargs, need, node.meta.get("val"), *(a.meta.get("val") for a in node.all_input_nodes))
    per_node = _SAVED_ITEMS.get(node)
    hit = per_node.get(mask_bytes) if per_node is not None else None
    if hit is not None and len(hit[0]) == len(guard) and all(x is y for x, y in zip(hit[0], guard)):
        return hit[1]
    items = _rule_items(node, mask_bytes)
    if per_node is None:
        per_node = _SAVED_ITEMS[node] = {}
    per_node[mask_bytes] = (guard, items)
    return items


def _rule_items(node: fx.Node, mask_bytes: int | None) -> list:
    if node.op != "call_function" or node not in grad_nodes(node.graph):
        return []
    if node.target is aten.dropout.default:
        rule = dropout_rule(mask_bytes)
    elif is_moe(node):
        rule = moe_save_rule
    else:
        rule = SAVE_RULES.get(node.target, default_rule)
    return [s for s in rule(node) if isinstance(s, Internal) or isinstance(node_value(s), torch.Tensor)]


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


def iter_saved(gm: fx.GraphModule | fx.Graph, dropout_mask_bytes: int | None = 1) -> Iterable[tuple[str, str, int]]:
    """(node, saved tensor, bytes) for every node that saves something — a debug view."""
    for node, items in _saved_by_node(_graph(gm), dropout_mask_bytes).items():
        for _, name, nbytes in items:
            yield node.name, name, nbytes
