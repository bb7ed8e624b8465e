"""Collectives as autograd Functions with explicit conjugate backward (DESIGN invariant 5).

Gradient convention (see ``autopar.sharding.placements``): the gradient of a Shard tensor is
sharded like it; that of a Replicate or Partial tensor is held in full on every rank. Under
it the conjugate pairs are:

=====================  =========================  ===============================
forward                placements                 backward
=====================  =========================  ===============================
all_reduce             P -> R                     identity
grad_all_reduce        R -> R (used split)        all_reduce   (Megatron's ``f``)
all_gather             S -> R                     local slice
all_gather_rs          S -> R (used split)        reduce_scatter (Megatron-SP)
reduce_scatter         P -> S                     all_gather
all_to_all             S(i) -> S(j)               all_to_all S(j) -> S(i)
local_slice            R -> S                     all_gather
to_partial             R -> P (rank 0 keeps)      identity
=====================  =========================  ===============================

Every call is counted in ``COUNTER`` (kind, bytes, axis, phase) so tests can check what ran;
bytes are the collective's full size (an all-gather's output), as ``plan.collectives`` lists them.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autopar.collectives.groups import axis as _axis
from autopar.collectives.watch import note
from autopar.sharding.placements import Shard, piece_of
from autopar.sharding.shard_params import join_pieces


@dataclass
class CommCounter:
    calls: list = field(default_factory=list)
    enabled: bool = False
    phase_override: str | None = None    # "recompute" while a checkpointed region re-runs in backward

    def record(self, kind: str, t: torch.Tensor, axis: str, phase: str, parts: int = 1) -> None:
        """Bytes are the collective's full size, as the plan lists them (``step_bytes``): an
        all-gather of ``parts`` pieces counts its output, ``t`` being one rank's piece. Every call is
        also noted for the error a failure raises (``watch.note``), counted or not. Not while
        torch.compile traces a compiled program (``compile=True``): a Python side effect in a
        collective's backward would break the graph there, so in-graph collectives go uncounted."""
        if torch.compiler.is_compiling():
            return
        note(kind, axis, self.phase_override or phase)
        if self.enabled:
            self.calls.append((kind, t.numel() * t.element_size() * parts, axis, self.phase_override or phase))

    def summary(self) -> Counter:
        return Counter((k, a, ph) for k, _, a, ph in self.calls)


COUNTER = CommCounter()


@contextlib.contextmanager
def count_collectives():
    """Record every collective run in the block: ``with count_collectives() as c: ...; c.calls``."""
    COUNTER.calls, COUNTER.enabled = [], True
    try:
        yield COUNTER
    finally:
        COUNTER.enabled = False


# ---- raw collectives over one axis (chunk-aware) ----------------------------------------

def _ar(t: torch.Tensor, ax, phase: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if ax.size == 1:
        return t.clone()
    t = t.contiguous().clone()
    COUNTER.record("all_reduce", t, ax.name, phase)
    dist.all_reduce(t, op=op, group=ax.group)
    return t


def _blocks(t: torch.Tensor, dim: int, chunks: int) -> list[torch.Tensor]:
    return list(t.chunk(chunks, dim)) if chunks > 1 else [t]


def _ag(t: torch.Tensor, dim: int, chunks: int, ax, phase: str, zigzag: bool = False) -> torch.Tensor:
    if ax.size == 1:
        return t.clone()
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(ax.size)]
    COUNTER.record("all_gather", t, ax.name, phase, ax.size)
    dist.all_gather(parts, t, group=ax.group)
    return join_pieces(parts, Shard(dim, chunks, zigzag))


def _piece(t: torch.Tensor, dim: int, chunks: int, n: int, rank: int, zigzag: bool) -> torch.Tensor:
    """Rank ``rank``'s piece of ``t`` under ``Shard(dim, chunks, zigzag)`` over ``n`` ranks."""
    return torch.cat([b.chunk(n, dim)[piece_of(rank, n, i, zigzag)] for i, b in enumerate(_blocks(t, dim, chunks))],
                     dim).contiguous()


def _slice(t: torch.Tensor, dim: int, chunks: int, ax, zigzag: bool = False) -> torch.Tensor:
    return _piece(t, dim, chunks, ax.size, ax.rank, zigzag)


def _rs(t: torch.Tensor, dim: int, chunks: int, ax, phase: str, zigzag: bool = False) -> torch.Tensor:
    if ax.size == 1:
        return t.clone()
    pieces = [_piece(t, dim, chunks, ax.size, r, zigzag) for r in range(ax.size)]
    if torch.compiler.is_compiling():       # dynamo traces the tensor form only (no graph break)
        from torch.distributed import _functional_collectives as funcol

        return funcol.reduce_scatter_tensor(torch.cat(pieces, 0), "sum", 0, ax.group)
    out = torch.empty_like(pieces[0])
    COUNTER.record("reduce_scatter", t, ax.name, phase)
    dist.reduce_scatter(out, pieces, group=ax.group)
    return out


def _a2a(t: torch.Tensor, src: int, dst: int, ax, phase: str) -> torch.Tensor:
    if ax.size == 1:
        return t.clone()
    ins = [c.contiguous() for c in t.chunk(ax.size, dst)]
    if torch.compiler.is_compiling():       # dynamo traces the tensor form only (no graph break)
        from torch.distributed import _functional_collectives as funcol

        got = funcol.all_to_all_single(torch.cat(ins, 0), None, None, ax.group)
        return torch.cat(got.chunk(ax.size, 0), src)
    outs = [torch.empty_like(ins[0]) for _ in range(ax.size)]
    COUNTER.record("all_to_all", t, ax.name, phase)
    dist.all_to_all(outs, ins, group=ax.group)
    return torch.cat(outs, src)


# ---- autograd Functions --------------------------------------------------------------

class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, name):
        return _ar(x, _axis(name), "fwd")

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, name):
        ctx.ax = _axis(name)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _ar(g, ctx.ax, "bwd"), None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, chunks, name, scatter_grad, zigzag=False):
        ctx.ax, ctx.dim, ctx.chunks, ctx.scatter, ctx.zz = _axis(name), dim, chunks, scatter_grad, zigzag
        return _ag(x, dim, chunks, ctx.ax, "fwd", zigzag)

    @staticmethod
    def backward(ctx, g):
        if ctx.scatter:
            return _rs(g, ctx.dim, ctx.chunks, ctx.ax, "bwd", ctx.zz), None, None, None, None, None
        return _slice(g, ctx.dim, ctx.chunks, ctx.ax, ctx.zz), None, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, chunks, name, zigzag=False):
        ctx.ax, ctx.dim, ctx.chunks, ctx.zz = _axis(name), dim, chunks, zigzag
        return _rs(x, dim, chunks, ctx.ax, "fwd", zigzag)

    @staticmethod
    def backward(ctx, g):
        return _ag(g, ctx.dim, ctx.chunks, ctx.ax, "bwd", ctx.zz), None, None, None, None


class _LocalSlice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, chunks, name, zigzag=False):
        ctx.ax, ctx.dim, ctx.chunks, ctx.zz = _axis(name), dim, chunks, zigzag
        return _slice(x, dim, chunks, ctx.ax, zigzag)

    @staticmethod
    def backward(ctx, g):
        return _ag(g, ctx.dim, ctx.chunks, ctx.ax, "bwd", ctx.zz), None, None, None, None


class _PartialGrad(torch.autograd.Function):
    """Identity forward; backward keeps the gradient on rank 0 of the axis only."""

    @staticmethod
    def forward(ctx, x, name):
        ctx.ax = _axis(name)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return (g if ctx.ax.rank == 0 else torch.zeros_like(g)), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, dst, name):
        ctx.ax, ctx.src, ctx.dst = _axis(name), src, dst
        return _a2a(x, src, dst, ctx.ax, "fwd")

    @staticmethod
    def backward(ctx, g):
        return _a2a(g, ctx.dst, ctx.src, ctx.ax, "bwd"), None, None, None


class _ToPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, name):
        return x.clone() if _axis(name).rank == 0 else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


# ---- the names per-rank code calls ------------------------------------------------------

def all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    """P -> R: sum over the axis."""
    return _AllReduce.apply(x, axis)


def grad_all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient (a replicated input used split)."""
    return _GradAllReduce.apply(x, axis)


def all_gather(x: torch.Tensor, dim: int, axis: str, chunks: int = 1, zigzag: bool = False) -> torch.Tensor:
    """S(dim) -> R (``Shard(dim, chunks, zigzag)``, as the other chunk-aware calls here)."""
    return _AllGather.apply(x, dim, chunks, axis, False, zigzag)


def all_gather_rs(x: torch.Tensor, dim: int, axis: str, chunks: int = 1, zigzag: bool = False) -> torch.Tensor:
    """S(dim) -> R whose consumers use it split: backward is a reduce-scatter."""
    return _AllGather.apply(x, dim, chunks, axis, True, zigzag)


def reduce_scatter(x: torch.Tensor, dim: int, axis: str, chunks: int = 1, zigzag: bool = False) -> torch.Tensor:
    """P -> S(dim)."""
    return _ReduceScatter.apply(x, dim, chunks, axis, zigzag)


def local_slice(x: torch.Tensor, dim: int, axis: str, chunks: int = 1, zigzag: bool = False) -> torch.Tensor:
    """R -> S(dim): keep this rank's piece."""
    return _LocalSlice.apply(x, dim, chunks, axis, zigzag)


def all_to_all(x: torch.Tensor, src: int, dst: int, axis: str) -> torch.Tensor:
    """S(src) -> S(dst)."""
    return _AllToAll.apply(x, src, dst, axis)


def to_partial(x: torch.Tensor, axis: str) -> torch.Tensor:
    """R -> P: rank 0 of the axis keeps the value, the others hold zeros."""
    return _ToPartial.apply(x, axis)


# Variants for parameters whose gradient is summed over the axis after backward (data
# parallel): every use must then leave a PARTIAL gradient, so these take autograd's own
# derivative (zero-padded slice, masked copy) or keep the gradient on rank 0 only.

def local_slice_pgrad(x: torch.Tensor, dim: int, axis: str, chunks: int = 1, zigzag: bool = False) -> torch.Tensor:
    """R -> S(dim) whose gradient stays partial (zero outside this rank's piece): plain autograd."""
    return _slice(x, dim, chunks, _axis(axis), zigzag)


def to_partial_pgrad(x: torch.Tensor, axis: str) -> torch.Tensor:
    """R -> P whose gradient stays partial (only rank 0's copy counts)."""
    return x if _axis(axis).rank == 0 else x * 0.0


def partial_grad(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Identity; the gradient of a replicated use counts once (on rank 0) in a later sum."""
    return _PartialGrad.apply(x, axis)


def all_reduce_value_start(x: torch.Tensor, axis: str):
    """Start a non-differentiable sum of a detached tensor over the axis; returns (result, work):
    ``work.wait()`` (when work is not None) before reading the result. Lets a step's loss report
    travel while backward runs."""
    ax = _axis(axis)
    t = x.detach().contiguous().clone()
    if ax.size == 1:
        return t, None
    COUNTER.record("all_reduce", t, ax.name, "fwd")
    return t, dist.all_reduce(t, group=ax.group, async_op=True)


def all_reduce_value(x: torch.Tensor, axis: str, op: str = "sum") -> torch.Tensor:
    """Non-differentiable all-reduce (sum or max) of a detached tensor."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
    return _ar(x.detach(), _axis(axis), "fwd", ops[op])
