"""conv1d/2d/3d (batch, output-channel, input-channel→Partial) and pooling (batch, channel)."""
from __future__ import annotations

from torch.ops import aten

from autopar.sharding.registry import register_rule
from autopar.sharding.rules.common import arg, pointwise_options
from autopar.sharding.rules.einsum import einsum_options
from autopar.sharding.strategy import shape_of, tensor_inputs


@register_rule(aten.conv2d.default, aten.conv1d.default, aten.conv3d.default)
def conv(node):
    ins = tensor_inputs(node)
    shapes = [shape_of(a) for a in ins]
    spatial = len(shapes[0]) - 2
    sp = "xyz"[:spatial]
    groups = arg(node, 6, "groups", 1)
    labels = ["nc" + sp, "oc" + "uvw"[:spatial]]
    additive = None
    if len(ins) == 3:
        labels.append(None)
        additive = {2: "o"}
    opts = einsum_options(labels, "no" + sp, shapes, additive=additive, no_shard=sp + "uvw",
                          partial_inputs=(0,))
    if groups != 1:
        opts = [o for o in opts if o.name.startswith("n")]
    return opts


@register_rule(aten.max_pool2d.default, aten.avg_pool2d.default, aten.adaptive_avg_pool2d.default,
               aten.max_pool1d.default, aten.avg_pool1d.default, aten.adaptive_avg_pool1d.default,
               aten.max_pool3d.default, aten.avg_pool3d.default, aten.adaptive_avg_pool3d.default)
def pool(node):
    n = len(shape_of(node))
    k = next(int(d) for d in "123" if f"{d}d" in str(node.target))
    spatial = tuple(range(n - k, n))
    return pointwise_options(node, skip_dims=spatial)
