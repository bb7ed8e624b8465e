"""What each aten op saves for backward: a registry ``{aten op: rule(node) -> [saved]}``
(``SAVE_RULES``, ``@saves(op)``). A saved item is a graph node (its whole storage is kept: views of
one base count once, ``memory.py`` dedups) or an :class:`Internal` tensor the op makes itself (a
dropout mask, the layer-norm statistics, a contiguous copy a matmul makes). Ops without a rule save
every tensor input (``default_rule``, conservative).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.graph.grads import grad_nodes

aten = torch.ops.aten


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


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def node_value(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if isinstance(node_value(a), torch.Tensor)]


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _out(node: fx.Node, index: int = 0) -> torch.Tensor:
    val = node_value(node)
    return val[index] if isinstance(val, (tuple, list)) else val


def _batched_view_or_copy(node: fx.Node, t: fx.Node, label: str) -> list:
    """A matmul operand: saved as is when folding it to 2-D/3-D is a view, else its copy."""
    val = node_value(t)
    if val.dim() <= 2:
        return [t]
    meta = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
    folded = meta.reshape(-1, *val.shape[-2:])
    if folded._base is not None:
        return [t]
    return [Internal(f"{node.name}.{label}", tensor_bytes(val))]


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
    width = 8 if node_value(node).dtype == torch.float64 else 4
    return Internal(f"{node.name}.{label}", 2 * count * width)


@saves(aten.layer_norm.default, aten.native_layer_norm.default)
def _layer_norm(node):
    x = node_value(node.args[0])
    normalized = math.prod(node.args[1])
    return [node.args[0], _stats(node, x.numel() // max(normalized, 1), "mean_rstd")]


@saves(aten.rms_norm.default)
def _rms_norm(node):
    x = node_value(node.args[0])
    normalized = math.prod(node.args[1])
    return [node.args[0], Internal(f"{node.name}.rstd", x.numel() // max(normalized, 1) * 4)]


@saves(aten.group_norm.default)
def _group_norm(node):
    x = node_value(node.args[0])
    return [node.args[0], _stats(node, x.shape[0] * node.args[1], "mean_rstd")]


@saves(
    aten.batch_norm.default,
    aten._native_batch_norm_legit_functional.default,
    aten._native_batch_norm_legit.default,
    aten.native_batch_norm.default,
)
def _batch_norm(node):
    x = node_value(node.args[0])
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
        x = node_value(node.args[0])
        per = x.element_size() if mask_bytes is None else mask_bytes
        return [Internal(f"{node.name}.mask", x.numel() * per)]

    return rule


@saves(aten.native_dropout.default)
def _native_dropout(node):
    x = node_value(node.args[0])
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
    x = node_value(node.args[0])
    return [Internal(f"{node.name}.log_probs", tensor_bytes(x)), node.args[1]]


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
    q = node_value(node.args[0])
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


def default_rule(node: fx.Node) -> list:
    """Unknown op: every tensor input (conservative)."""
    return _tensor_args(node)
