"""Elementwise ops: shard any dim; linear ones pass Partial through."""
from __future__ import annotations

from torch.ops import aten

from autopar.sharding.registry import register_rule
from autopar.sharding.rules.common import pointwise_options
from autopar.sharding.strategy import tensor_inputs

_UNARY_LINEAR = [aten.neg.default, aten.clone.default, aten.alias.default, aten.contiguous.default,
                 aten.detach.default, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default,
                 aten.type_as.default, aten.positive.default]
_NONLINEAR = [aten.relu.default, aten.gelu.default, aten.silu.default, aten.tanh.default, aten.sigmoid.default,
              aten.rsqrt.default, aten.sqrt.default, aten.exp.default, aten.log.default, aten.pow.Tensor_Scalar,
              aten.pow.Tensor_Tensor, aten.abs.default, aten.erf.default, aten.sin.default, aten.cos.default,
              aten.reciprocal.default, aten.leaky_relu.default, aten.hardtanh.default, aten.elu.default,
              aten.softplus.default, aten.mish.default, aten.hardswish.default, aten.hardsigmoid.default,
              aten.dropout.default, aten.eq.Scalar, aten.eq.Tensor, aten.ne.Scalar, aten.ne.Tensor,
              aten.ge.Scalar, aten.ge.Tensor, aten.gt.Scalar, aten.gt.Tensor, aten.le.Scalar, aten.le.Tensor,
              aten.lt.Scalar, aten.lt.Tensor, aten.masked_fill.Scalar, aten.masked_fill.Tensor,
              aten.where.self, aten.logical_not.default, aten.__and__.Tensor, aten.__or__.Tensor,
              aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_not.default, aten.minimum.default,
              aten.maximum.default, aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default,
              aten.rsub.Scalar, aten.square.default, aten.sign.default, aten.floor.default, aten.ceil.default,
              aten.round.default]


@register_rule(*_UNARY_LINEAR)
def unary_linear(node):
    return pointwise_options(node, linear="unary")


@register_rule(*_NONLINEAR)
def nonlinear(node):
    return pointwise_options(node)


@register_rule(aten.add.Tensor, aten.sub.Tensor)
def add_sub(node):
    return pointwise_options(node, linear="all" if len(tensor_inputs(node)) == 2 else "none")


@register_rule(aten.mul.Tensor, aten.mul.Scalar)
def mul(node):
    return pointwise_options(node, linear="each")


@register_rule(aten.div.Tensor, aten.div.Scalar)
def div(node):
    return pointwise_options(node, linear="first")


@register_rule(aten.add.Scalar, aten.sub.Scalar)
def add_scalar(node):
    return pointwise_options(node)
