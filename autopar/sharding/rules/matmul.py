"""linear / addmm / mm / bmm / matmul: data (batch), column (output features) and row
(contracted, Partial output) splits, Megatron's layouts among them."""
from __future__ import annotations

from torch.ops import aten

from autopar.sharding.registry import register_rule
from autopar.sharding.rules.common import chunk_hint
from autopar.sharding.rules.einsum import einsum_options, letters
from autopar.sharding.strategy import shape_of, tensor_inputs


@register_rule(aten.linear.default)
def linear(node):
    ins = tensor_inputs(node)
    shapes = [shape_of(a) for a in ins]
    nb = len(shapes[0]) - 1
    batch = letters(nb)
    labels = [batch + "k", "nk"]
    additive = {2: "n"} if len(ins) == 3 else None
    if additive:
        labels.append(None)
    return einsum_options(labels, batch + "n", shapes, additive=additive, partial_inputs=(0,),
                          chunks={"n": chunk_hint(node)})


@register_rule(aten.addmm.default)
def addmm(node):
    shapes = [shape_of(a) for a in tensor_inputs(node)]
    bias = "mn"[2 - len(shapes[0]):] if shapes[0] else ""
    return einsum_options([None, "mk", "kn"], "mn", shapes, additive={0: bias}, partial_inputs=(1,),
                          chunks={"n": chunk_hint(node)})


@register_rule(aten.mm.default)
def mm(node):
    shapes = [shape_of(a) for a in tensor_inputs(node)]
    return einsum_options(["mk", "kn"], "mn", shapes, partial_inputs=(0, 1), chunks={"n": chunk_hint(node)})


@register_rule(aten.bmm.default)
def bmm(node):
    shapes = [shape_of(a) for a in tensor_inputs(node)]
    return einsum_options(["bmk", "bkn"], "bmn", shapes, partial_inputs=(0, 1))


@register_rule(aten.matmul.default)
def matmul(node):
    ins = tensor_inputs(node)
    if len(ins) != 2:
        return []
    a, b = (shape_of(x) for x in ins)
    if len(a) < 2 or len(b) < 2:
        return []
    out = shape_of(node)
    nb = len(out) - 2
    batch = letters(nb, 3)
    la = batch[nb - (len(a) - 2):] + "mk"
    lb = batch[nb - (len(b) - 2):] + "kn"
    return einsum_options([la, lb], batch + "mn", [a, b], partial_inputs=(0, 1), chunks={"n": chunk_hint(node)})
