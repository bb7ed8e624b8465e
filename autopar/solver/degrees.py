"""What a plan actually splits on each mesh axis: the roles behind ``plan.degrees``.

On mesh axis ``a``, an op's compute is *split* when it consumes a tensor input, or produces an
output, as anything but Replicate on ``a``. It is *batch-split* when it consumes a value that
carries the batch split on ``a`` along that split:

    carries(input or target, dim 0)  where its spec on ``a`` is Shard(0)
    carries(op output, dim d)        where the op is batch-split and the output is Shard(d) on ``a``

A batch-split op's Partial output (a sum over the batch: the loss) ends the batch split; a value
consumed Replicate on ``a`` (gathered) no longer carries it. An op whose output is split on ``a``
along the batch's dimension is batch-split too, whatever its inputs (the split re-made after a
replicated op: token ids kept whole, the embedding's output cut by rows). The batch's dimension of
a value (``_batch_dims``) follows dim 0 of the inputs through ops that keep its size at its index.
Each op weighs its FLOPs (forward + backward, at least 1), and the axis takes the role of the
largest share of the compute:

    "dp"    batch-split ops (data parallel),
    "tp"    ops split otherwise (tensor parallel),
    "none"  ops not split on it: every rank on the axis repeats that work (its parameters may
            still be stored split, which saves memory only).

Ties go to "dp", then "tp". ``degrees = {"dp": prod of dp axis sizes, "tp": prod of tp axis
sizes, "pp": 1, "ep": ..., "cp": ...}``, where (``split_axes_of``)

    "ep"    prod of the sizes of the axes on which some MoE experts node (local family "moe") has
            role "ep" or "experts": its experts stored split there (the contract of
            ``sharding/rules/moe.py``); an "ep" axis is also counted by its "dp" or "tp" role,
    "cp"    prod of the sizes of the axes on which some attention node's strategy is named "cp"
            (context parallel: the sequence split); counted by its role too.
"""
from __future__ import annotations

import math

import torch.fx as fx

from autopar.core import search_memo
from autopar.cost_models.compute import node_work
from autopar.sharding.candidates import producer
from autopar.sharding.placements import Replicate, Shard
from autopar.sharding.strategy import tensor_inputs

DP, TP, NONE = "dp", "tp", "none"


def _outs(decision) -> list:
    out = decision.output
    return list(out) if isinstance(out, list) else [out]


def _ndim(node: fx.Node, idx) -> int:
    v = node.meta.get("val")
    v = v[idx] if idx is not None and isinstance(v, (tuple, list)) else v
    return v.dim() if hasattr(v, "dim") else 0


def _sharded_dim(p, ndim: int):
    return p.dim % ndim if isinstance(p, Shard) and ndim else None


def _batch_dims(gm: fx.GraphModule, inputs: dict) -> dict[tuple, int]:
    """(node name, output index) -> the dimension holding the batch's rows: dim 0 of the inputs,
    then the same dim of an op's output where some input has it there with the same size."""
    def shape(node, idx):
        v = node.meta.get("val")
        v = v[idx] if idx is not None and isinstance(v, (tuple, list)) else v
        return tuple(v.shape) if hasattr(v, "shape") else None

    dims = {(ph, None): 0 for ph in inputs}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        found = []
        for arg in tensor_inputs(node):
            src, idx = producer(arg)
            k, s = dims.get((src.name, idx)), shape(src, idx)
            if k is not None and s is not None and k < len(s):
                found.append((k, s[k]))
        if not found:
            continue
        v = node.meta.get("val")
        outs = list(range(len(v))) if isinstance(v, (tuple, list)) else [None]
        for j in outs:
            s = shape(node, j)
            hit = next((k for k, n in found if s is not None and k < len(s) and s[k] == n), None)
            if hit is not None:
                dims[(node.name, j)] = hit
    return dims


def _weight(node: fx.Node) -> float:
    work = node_work(node)
    return max(1.0, work.flops_fwd + work.flops_bwd)


def _weights(gm: fx.GraphModule):
    """node -> ``_weight(node)``, kept per graph in ``gm.meta`` under ``search_memo`` (every plan of one
    graph weighs its nodes alike)."""
    if not search_memo.ENABLED or not hasattr(gm, "meta"):
        return _weight
    by_node = search_memo.graph_cache(gm, "axis_share_weights", by_node={})["by_node"]

    def weight(node: fx.Node) -> float:
        hit = by_node.get(node.name)
        if hit is None or hit[0] is not node:
            hit = by_node[node.name] = (node, _weight(node))
        return hit[1]
    return weight


def _axis_shares(gm: fx.GraphModule, nodes: dict, inputs: dict, a: int, bdims: dict | None = None
                 ) -> dict[str, float]:
    """Weight of the batch-split ops ("dp"), of the ops split otherwise ("tp") and of the ops not
    split ("none") on mesh axis ``a``."""
    bdims = _batch_dims(gm, inputs) if bdims is None else bdims
    carries: dict[tuple, int] = {}
    for ph, spec in inputs.items():
        p = spec[a]
        if isinstance(p, Shard) and p.dim == 0:
            carries[(ph, None)] = 0
    shares = {DP: 0.0, TP: 0.0, NONE: 0.0}
    weights = _weights(gm)
    for node in gm.graph.nodes:
        d = nodes.get(node.name)
        if node.op != "call_function" or d is None:
            continue
        weight = weights(node)
        ins, outs = list(d.inputs), _outs(d)
        if all(isinstance(s[a], Replicate) for s in ins + outs if s):
            shares[NONE] += weight
            continue
        on_batch = False
        for i, arg in enumerate(tensor_inputs(node)[:len(ins)]):
            src, idx = producer(arg)
            k = carries.get((src.name, idx))
            on_batch |= k is not None and _sharded_dim(ins[i][a], _ndim(src, idx)) == k
        multi = isinstance(d.output, list)
        for j, spec in enumerate(outs):
            if not on_batch and spec:
                key = (node.name, j if multi else None)
                dim = _sharded_dim(spec[a], _ndim(node, j if multi else None))
                on_batch = dim is not None and bdims.get(key) == dim
        shares[DP if on_batch else TP] += weight
        if not on_batch:
            continue
        for j, spec in enumerate(outs):
            dim = _sharded_dim(spec[a], _ndim(node, j if multi else None)) if spec else None
            if dim is not None:
                carries[(node.name, j if multi else None)] = dim
    return shares


def axis_shares(gm: fx.GraphModule, nodes: dict, inputs: dict, axis_names: tuple, mesh_shape: tuple) -> dict:
    """Mesh axis name -> {"dp": fraction, "tp": fraction, "none": fraction} of the compute (module docstring)."""
    out, bdims = {}, _batch_dims(gm, inputs)
    for a, name in enumerate(axis_names):
        shares = _axis_shares(gm, nodes, inputs, a, bdims) if mesh_shape[a] > 1 else {DP: 0.0, TP: 0.0, NONE: 1.0}
        total = sum(shares.values()) or 1.0
        out[name] = {k: v / total for k, v in shares.items()}
    return out


def role(shares: dict) -> str:
    """The role of the largest share (ties: "dp", then "tp")."""
    return max((DP, TP, NONE), key=lambda k: (shares[k], -(DP, TP, NONE).index(k)))


EP_ROLES = ("ep", "experts")        # local roles of the "moe" family that keep the experts split


def _axis_names_of(strategy: str, ndim: int) -> list[str]:
    """Per-axis strategy names of a mesh strategy's name (``"ep×replicate"``; ``sharding/strategy.py``)."""
    parts = strategy.split("×")
    return parts if len(parts) == ndim else [""] * ndim


def split_axes_of(nodes: dict, mesh_shape: tuple) -> dict[str, set[int]]:
    """{"ep": axes, "cp": axes} of a plan's node decisions (module docstring), axes of size > 1."""
    ndim = len(mesh_shape)
    out: dict[str, set[int]] = {"ep": set(), "cp": set()}
    for d in nodes.values():
        for a, loc in enumerate(d.local or ()):
            if a < ndim and loc and loc.split(":")[0] == "moe" and loc.split(":")[-1] in EP_ROLES:
                out["ep"].add(a)
        if "attention" in d.op:
            out["cp"].update(a for a, n in enumerate(_axis_names_of(d.strategy, ndim)) if n == "cp")
    return {k: {a for a in v if mesh_shape[a] > 1} for k, v in out.items()}


def degrees_of(roles: dict, axis_names: tuple, mesh_shape: tuple, nodes: dict | None = None) -> dict:
    """``plan.degrees`` (module docstring) from the axis roles and, for "ep" and "cp", the node decisions;
    an axis that splits the sequence of attention counts as "cp", not "tp"."""
    size = dict(zip(axis_names, mesh_shape))
    split = split_axes_of(nodes or {}, mesh_shape)
    return {"dp": math.prod(size[n] for n, r in roles.items() if r == DP),
            "tp": math.prod(size[n] for n, r in roles.items()
                            if r == TP and axis_names.index(n) not in split["cp"]), "pp": 1,
            "ep": math.prod(mesh_shape[a] for a in split["ep"]), "cp": math.prod(mesh_shape[a] for a in split["cp"])}
