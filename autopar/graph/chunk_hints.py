"""Mark fused projections (QKV) whose last dim is later split into k equal parts.

Walks up from ``split``/``chunk`` nodes with k equal pieces on the last dim through views that
keep the last dim and through elementwise adds, to the producing linear/addmm/mm, and tags
every node on the way (and the weight/bias placeholders) with ``meta["chunk_hint"] = k``.
Rules then offer ``Shard(dim, chunks=k)`` so a column split keeps q, k and v each split.
MoE experts' fused gate/up parameters are tagged too (``graph/moe_chunk_hints.py``).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.ops import aten

from autopar.graph.moe_chunk_hints import mark_moe_chunk_hints

_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unsafe_split.Tensor}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.contiguous.default,
          aten.clone.default, aten.alias.default}
_ADD = {aten.add.Tensor}
_PROJ = {aten.linear.default, aten.addmm.default, aten.mm.default, aten.matmul.default}


def _last(node) -> int | None:
    v = node.meta.get("val")
    return v.shape[-1] if isinstance(v, torch.Tensor) and v.dim() else None


def mark_chunk_hints(gm: fx.GraphModule) -> int:
    marked = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _SPLITS:
            continue
        outs = node.meta.get("val") or []
        src = node.args[0]
        nd = src.meta["val"].dim()
        dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % nd
        sizes = {o.shape[dim] for o in outs}
        if dim != nd - 1 or len(sizes) != 1 or len(outs) < 2:
            continue
        k = len(outs)
        cur, last = src, _last(src)
        path = []
        while isinstance(cur, fx.Node) and cur.op == "call_function":
            path.append(cur)
            if cur.target in _PROJ:
                break
            if cur.target in _VIEWS and _last(cur.args[0]) == last:
                cur = cur.args[0]
            elif cur.target in _ADD:
                cur = max((a for a in cur.args if isinstance(a, fx.Node)), key=lambda a: a.meta["val"].dim())
            else:
                path = []
                break
        if not path or path[-1].target not in _PROJ:
            continue
        proj = path[-1]
        for n in path:
            n.meta["chunk_hint"] = k
        for a in proj.args:
            if isinstance(a, fx.Node) and a.op == "placeholder":
                a.meta["chunk_hint"] = k
        for n in path:
            if n.target in _ADD:
                for a in n.args:
                    if isinstance(a, fx.Node) and a.op == "placeholder":
                        a.meta["chunk_hint"] = k
        marked += 1
    return marked + mark_moe_chunk_hints(gm)
