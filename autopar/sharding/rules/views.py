"""View and data-movement ops: view/reshape/flatten (dim groups), transpose/permute,
(un)squeeze, expand, slice/select, cat, split/chunk/unbind. All are linear (Partial passes)."""
from __future__ import annotations

import math

from torch.ops import aten

from autopar.sharding.placements import P, R, Shard
from autopar.sharding.registry import register_rule
from autopar.sharding.rules.common import arg, chunk_hint
from autopar.sharding.strategy import AxisStrategy, shape_of, tensor_inputs


def view_groups(src: tuple, dst: tuple) -> list[tuple[list[int], list[int]]]:
    """Pair runs of dims with equal products: [B,S,H] -> [B,S,h,d] gives ([0],[0]),([1],[1]),([2],[2,3])."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj = [], []
        pi = pj = 1
        if i < len(src):
            gi.append(i); pi *= src[i]; i += 1
        if j < len(dst):
            gj.append(j); pj *= dst[j]; j += 1
        while pi != pj:
            if pi < pj and i < len(src):
                gi.append(i); pi *= src[i]; i += 1
            elif j < len(dst):
                gj.append(j); pj *= dst[j]; j += 1
            else:
                break
        groups.append((gi, gj))
    return groups


def _major(dims: list[int], shape: tuple) -> int | None:
    for d in dims:
        if shape[d] != 1:
            return d
    return None


def _view_options(node, src: tuple, dst: tuple) -> list[AxisStrategy]:
    opts = [AxisStrategy((P,), P, None, "P")]
    hint = chunk_hint(node)
    for gi, gj in view_groups(src, dst):
        a, b = _major(gi, src), _major(gj, dst)
        if a is None or b is None:
            continue
        opts.append(AxisStrategy((Shard(a),), Shard(b), None, f"S{a}→S{b}"))
        opts += _inner_options(gi, gj, src, dst)
        if hint > 1 and len(gi) == 1 and len(gj) == 1 and a == len(src) - 1 and b == len(dst) - 1:
            opts.append(AxisStrategy((Shard(a, hint),), Shard(b, hint), None, f"S{a}/{hint}"))
    return opts


def _inner_options(gi: list[int], gj: list[int], src: tuple, dst: tuple) -> list[AxisStrategy]:
    """A merge of dims split on an inner one: ``[B,T,V] -> [B*T,V]`` with T split is the merged
    dim split block-wise, ``Shard(0, chunks=B)`` (each of the B blocks split alike: a sequence split
    kept through a flatten); and its inverse for the unflatten."""
    opts = []
    if len(gj) == 1 and len(gi) > 1:
        for m in range(1, len(gi)):
            k = math.prod(src[d] for d in gi[:m])
            if k > 1 and src[gi[m]] > 1:
                opts.append(AxisStrategy((Shard(gi[m]),), Shard(gj[0], k), None, f"S{gi[m]}→S{gj[0]}/{k}"))
    if len(gi) == 1 and len(gj) > 1:
        for m in range(1, len(gj)):
            k = math.prod(dst[d] for d in gj[:m])
            if k > 1 and dst[gj[m]] > 1:
                opts.append(AxisStrategy((Shard(gi[0], k),), Shard(gj[m]), None, f"S{gi[0]}/{k}→S{gj[m]}"))
    return opts


@register_rule(aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
               aten.unflatten.int, aten.view_as.default, aten.reshape_as.default)
def view(node):
    src = shape_of(tensor_inputs(node)[0])
    return _view_options(node, src, shape_of(node))


def _perm_options(perm: list[int]) -> list[AxisStrategy]:
    opts = [AxisStrategy((P,), P, None, "P")]
    for out_d, in_d in enumerate(perm):
        opts.append(AxisStrategy((Shard(in_d),), Shard(out_d), None, f"S{in_d}→S{out_d}"))
    return opts


@register_rule(aten.transpose.int)
def transpose(node):
    n = len(shape_of(node))
    d0, d1 = arg(node, 1, "dim0") % n, arg(node, 2, "dim1") % n
    perm = list(range(n))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return _perm_options(perm)


@register_rule(aten.t.default)
def t(node):
    n = len(shape_of(node))
    return _perm_options(list(range(n))[::-1])


@register_rule(aten.permute.default)
def permute(node):
    n = len(shape_of(node))
    return _perm_options([d % n for d in arg(node, 1, "dims")])


@register_rule(aten.unsqueeze.default)
def unsqueeze(node):
    n = len(shape_of(node))
    d = arg(node, 1, "dim") % n
    opts = [AxisStrategy((P,), P, None, "P")]
    for i in range(n - 1):
        opts.append(AxisStrategy((Shard(i),), Shard(i if i < d else i + 1), None, f"S{i}"))
    return opts


@register_rule(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def squeeze(node):
    src, dst = shape_of(tensor_inputs(node)[0]), shape_of(node)
    return _view_options(node, src, dst)


@register_rule(aten.expand.default)
def expand(node):
    src, dst = shape_of(tensor_inputs(node)[0]), shape_of(node)
    off = len(dst) - len(src)
    opts = [AxisStrategy((P,), P, None, "P")]
    for d in range(len(dst)):
        j = d - off
        if j < 0 or src[j] == 1:
            opts.append(AxisStrategy((R,), Shard(d), None, f"R→S{d}"))
        else:
            opts.append(AxisStrategy((Shard(j),), Shard(d), None, f"S{d}"))
    return opts


@register_rule(aten.slice.Tensor)
def slice_(node):
    src = shape_of(tensor_inputs(node)[0])
    n = len(src)
    dim = arg(node, 1, "dim", 0) % n
    start, end, step = arg(node, 2, "start", None), arg(node, 3, "end", None), arg(node, 4, "step", 1)
    full = (start in (None, 0)) and (end is None or end >= src[dim]) and step == 1
    opts = [AxisStrategy((P,), P, None, "P")]
    for d in range(n):
        if d != dim or full:
            opts.append(AxisStrategy((Shard(d),), Shard(d), None, f"S{d}"))
    return opts


@register_rule(aten.select.int)
def select(node):
    n = len(shape_of(tensor_inputs(node)[0]))
    dim = arg(node, 1, "dim") % n
    opts = [AxisStrategy((P,), P, None, "P")]
    for d in range(n):
        if d != dim:
            opts.append(AxisStrategy((Shard(d),), Shard(d if d < dim else d - 1), None, f"S{d}"))
    return opts


@register_rule(aten.cat.default)
def cat(node):
    ins = tensor_inputs(node)
    n = len(shape_of(node))
    dim = arg(node, 1, "dim", 0) % n
    opts = [AxisStrategy(tuple(P for _ in ins), P, None, "P")]
    for d in range(n):
        if d != dim:
            opts.append(AxisStrategy(tuple(Shard(d) for _ in ins), Shard(d), None, f"S{d}"))
    return opts


def _split_options(node, dim: int, equal: bool, n_out: int) -> list[AxisStrategy]:
    n = len(shape_of(tensor_inputs(node)[0]))
    dim %= n
    outs = node.meta["val"]
    opts = [AxisStrategy((P,), tuple(P for _ in outs), None, "P")]
    for d in range(n):
        if d != dim:
            opts.append(AxisStrategy((Shard(d),), tuple(Shard(d) for _ in outs), None, f"S{d}"))
    if equal and n_out > 1:
        opts.append(AxisStrategy((Shard(dim, n_out),), tuple(Shard(dim) for _ in outs), None, f"S{dim}/{n_out}"))
    return opts


@register_rule(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unsafe_split.Tensor)
def split(node):
    outs = node.meta["val"]
    dim = arg(node, 2, "dim", 0)
    sizes = {tuple(o.shape)[dim] for o in outs}
    return _split_options(node, dim, len(sizes) == 1, len(outs))


@register_rule(aten.unbind.int)
def unbind(node):
    n = len(shape_of(tensor_inputs(node)[0]))
    dim = arg(node, 1, "dim", 0) % n
    outs = node.meta["val"]
    opts = [AxisStrategy((P,), tuple(P for _ in outs), None, "P")]
    for d in range(n):
        if d != dim:
            opts.append(AxisStrategy((Shard(d),), tuple(Shard(d if d < dim else d - 1) for _ in outs), None, f"S{d}"))
    return opts


@register_rule(aten.broadcast_tensors.default)
def broadcast_tensors(node):
    """Every output has the broadcast shape: shard any of its dims; broadcast inputs stay R."""
    ins = tensor_inputs(node)
    outs = node.meta["val"]
    out = tuple(outs[0].shape)
    n = len(out)
    opts = [AxisStrategy(tuple(P for _ in ins), tuple(P for _ in outs), None, "P")]
    for d in range(n):
        if out[d] == 1:
            continue
        pl = []
        for a in ins:
            s = shape_of(a)
            j = d - (n - len(s))
            pl.append(Shard(j) if j >= 0 and s[j] == out[d] else R)
        opts.append(AxisStrategy(tuple(pl), tuple(Shard(d) for _ in outs), None, f"S{d}"))
    return opts
