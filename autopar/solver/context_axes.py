"""A mesh axis named ``"cp"`` (or ``"context"``) splits the sequence (context parallelism).

SEMI_AUTO and AUTO on a named mesh: every model input and the target not annotated otherwise
is split along dim 1 (the sequence of a ``[batch, seq, ...]`` input; whole where it has no
dim 1 that the axis divides), and every op downstream of them keeps an output split on the cp
axes where it has such a strategy, as DATA keeps the batch split: without it a small model is
cheaper gathered at once, and the axis would repeat the work. Attention splits its sequence
there with a ``"cp"`` strategy (``sharding/rules/attention.py``): on a named cp axis an attention
op that has one takes it (a heads split there would be tensor parallelism the user did not ask for).

Causal attention (an op with ``is_causal`` set, or an input annotated ``Shard(1, 2, zigzag=True)``
on a cp axis: Hugging Face models trace their causal mask as a tensor) makes the cp axes hold the
sequence in the zig-zag order (``zigzag_axes``; ``sharding/zigzag.py`` turns every candidate's split there into
``Z(dim)``, and a user's ``Shard`` annotation on them means that order too), so every rank does
the same attention work; where the sequence does not divide into ``2 x cp`` chunks, or no
attention is causal, the pieces stay contiguous.
"""
from __future__ import annotations

import math

from torch.ops import aten

from autopar.plan.plan import CandidateError, PlanError
from autopar.sharding.placements import R, Replicate, Shard, zigzag_of
from autopar.sharding.strategy import tensor_inputs
from autopar.sharding.zigzag import zigzag_candidates

ROLE_CONTEXT = ("cp", "context")


def context_axes(mesh) -> list[int]:
    return [i for i, n in enumerate(mesh.axis_names) if n in ROLE_CONTEXT]


def _causal_sequences(traced) -> list[int] | None:
    """The sequence lengths (dim -2 of queries and keys) of the attention ops, when one is causal."""
    seqs, causal = [], False
    for node in traced.gm.graph.nodes:
        if node.op == "call_function" and node.target is aten.scaled_dot_product_attention.default:
            flag = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
            causal |= bool(flag)
            seqs += [int(a.meta["val"].shape[-2]) for a in tensor_inputs(node)[:2]]
    return seqs if causal else None


def _asked(mesh, input_ann: dict) -> bool:
    """Whether an input annotation puts a cp axis in the zig-zag order (``Shard(1, 2, zigzag=True)``)."""
    names = {mesh.axis_names[a] for a in context_axes(mesh)}
    return any(getattr(p, "zigzag", False) for pl in input_ann.values() for ax, p in pl.items() if ax in names)


def zigzag_axes(traced, mesh, input_ann: dict | None = None) -> list[int]:
    """The cp axes that hold the sequence in the zig-zag order: all of them when an attention op is
    causal (or an input annotation asks for it: an explicit mask tensor's pattern is not known when
    planning) and every attention sequence and dim 1 of every input and target that has one divides
    into ``2 x cp`` chunks; none otherwise."""
    axes = context_axes(mesh)
    seqs = _causal_sequences(traced) if axes else None
    if seqs is None and axes and _asked(mesh, input_ann or {}):
        seqs = [int(a.meta["val"].shape[-2]) for n in traced.gm.graph.nodes
                if n.op == "call_function" and n.target is aten.scaled_dot_product_attention.default
                for a in tensor_inputs(n)[:2]]
    if not seqs:
        return []
    cp = 2 * math.prod(mesh.shape[a] for a in axes)
    names = list(traced.inputs) + ([traced.target] if traced.target else [])
    dims = [s[1] for s in (tuple(traced.node(n).meta["val"].shape) for n in names) if len(s) >= 2 and s[1] > 1]
    return [] if any(s % cp for s in seqs + dims) else axes


def sequence_order(traced, mesh, cands, param_ann: dict, input_ann: dict):
    """``(cands, param_ann, input_ann)`` for ``mesh``: on the zig-zag axes the candidates' splits and
    the annotations' ``Shard``s in the zig-zag order (the candidates cached per traced graph)."""
    axes = zigzag_axes(traced, mesh, input_ann)
    if not axes:
        if _asked(mesh, input_ann):
            cp = math.prod(mesh.shape[a] for a in context_axes(mesh))
            raise PlanError(f"an input is annotated in the zig-zag order (Shard(1, 2, zigzag=True)) on the cp axes, "
                            f"but the model has no scaled_dot_product_attention whose sequence, and dim 1 of every "
                            f"input and the target, divide into 2 x {cp} = {2 * cp} chunks; annotate Shard(1) (the "
                            f"contiguous split) or use a sequence length that is a multiple of {2 * cp}")
        return cands, param_ann, input_ann
    cache = traced.meta.setdefault("zigzag_candidates", {})
    key = (id(cands), tuple(axes))
    if key not in cache:
        cache[key] = zigzag_candidates(traced.gm, cands, set(axes), mesh.shape)
    names = {mesh.axis_names[a] for a in axes}

    def turn(ann: dict) -> dict:
        return {k: {ax: zigzag_of(p) if ax in names else p for ax, p in pl.items()} for k, pl in ann.items()}

    return cache[key], turn(param_ann), turn(input_ann)


def fed_by_inputs(traced) -> set[str]:
    """The nodes downstream of the model's inputs or the target (not those placeholders themselves)."""
    sources = set(traced.inputs) | ({traced.target} if traced.target else set())
    downstream = set()
    for node in traced.gm.graph.nodes:
        if node.name in sources or any(a.name in downstream for a in node.all_input_nodes):
            downstream.add(node.name)
    return downstream - sources


def keep_sequence_split(traced, cands, mesh, input_ann: dict, allowed: dict, only) -> None:
    """Inputs split along the sequence on the cp axes (of size > 1); their downstream ops keep it split."""
    axes = [a for a in context_axes(mesh) if mesh.shape[a] > 1]
    if not axes:
        return
    cp = math.prod(mesh.shape[a] for a in axes)
    zz = set(zigzag_axes(traced, mesh, input_ann))
    phs = list(enumerate(traced.inputs)) + ([(None, traced.target)] if traced.target else [])
    for i, ph in phs:
        if i in input_ann:
            continue
        shape = tuple(traced.node(ph).meta["val"].shape)
        if len(shape) >= 2 and shape[1] % cp:
            raise CandidateError(f"the sequence ({shape[1]}, dim 1 of {ph!r}) is not divisible by the context-parallel "
                                 f"size {cp} (mesh axes {[mesh.axis_names[a] for a in axes]}); use a sequence length "
                                 f"that is a multiple of {cp}")
        split = Shard(1) if len(shape) >= 2 and shape[1] > 1 else R
        want = {a: zigzag_of(split) if a in zz else split for a in axes}
        current = set(allowed.get(ph, range(len(cands.strategies[ph]))))
        idx = [k for k in only(ph, lambda spec: all(spec[a] == want[a] for a in axes)) if k in current]
        allowed[ph] = idx
    # repeated layers share their strategy lists (``sharding/candidates``): each list is read once
    split_out: dict[int, frozenset[int]] = {}
    for name in fed_by_inputs(traced):
        strategies = cands.strategies.get(name)
        if not strategies:
            continue
        if id(strategies) not in split_out:
            split_out[id(strategies)] = frozenset(
                k for k, st in enumerate(strategies)
                if all(not isinstance(spec[a], Replicate) for spec in _outs(st) for a in axes))
        ok = split_out[id(strategies)]
        keep = [k for k in allowed.get(name, range(len(strategies))) if k in ok]
        if keep:
            allowed[name] = keep
    on_cp: dict[int, frozenset[int] | None] = {}
    for name, strategies in cands.strategies.items():
        if id(strategies) not in on_cp:
            names = [st.name.split("×") for st in strategies]
            cp_named = [len(n) == len(mesh.shape) and all(n[a] == "cp" for a in axes) for n in names]
            any_cp = any(n[a] == "cp" for n in names if len(n) == len(mesh.shape) for a in axes)
            on_cp[id(strategies)] = frozenset(k for k, ok in enumerate(cp_named) if ok) if any_cp else None
        ok = on_cp[id(strategies)]
        if ok is None:
            continue
        keep = [k for k in allowed.get(name, range(len(strategies))) if k in ok]
        if keep:
            allowed[name] = keep


def _outs(st):
    o = st.output
    return list(o) if o and isinstance(o[0], tuple) else [o]
