"""Redistribution table: the collectives that turn placement spec A into spec B.

Per axis: S→R all-gather, P→R all-reduce, P→S reduce-scatter, S(i)→S(j) all-to-all,
R→S local slice, R→P keep-on-rank-0. Axes that un-shard go last-to-first and axes that
shard go first-to-last, so a dim sharded on several axes keeps axis 0 as the outer split.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from autopar.sharding.placements import Partial, Replicate, Shard, Spec


@dataclass(frozen=True)
class Step:
    kind: str        # all_gather | all_reduce | reduce_scatter | all_to_all | local_slice | to_partial
    axis: int
    dim: int = 0
    chunks: int = 1
    dst_dim: int = 0
    zigzag: bool = False     # the Shard's zig-zag order (``placements.Shard``)

    @property
    def communicates(self) -> bool:
        return self.kind not in ("local_slice", "to_partial")


def _other_axes_shard(spec, axis, dim) -> bool:
    return any(isinstance(p, Shard) and p.dim == dim for a, p in enumerate(spec) if a != axis)


def _inner_sharding(cur, axis, dim) -> list[int]:
    """Axes after ``axis`` that currently shard ``dim`` (they are the finer split)."""
    return [b for b in range(axis + 1, len(cur)) if isinstance(cur[b], Shard) and cur[b].dim == dim]


@functools.lru_cache(maxsize=1 << 16)
def cached_steps(src: Spec, dst: Spec) -> tuple[Step, ...]:
    """``redistribute_steps`` as a tuple, memoised (the solver prices every pair of specs of every edge)."""
    return tuple(redistribute_steps(src, dst))


def redistribute_steps(src: Spec, dst: Spec) -> list[Step]:
    """Steps from ``src`` to ``dst``. A dim split over several axes is split by axis 0 first,
    so changing an outer axis's split first gathers the inner axes on that dim (re-sliced
    at the end)."""
    if src == dst:
        return []
    cur = list(src)
    steps: list[Step] = []
    k = len(src)

    def gather(a):
        steps.append(Step("all_gather", a, cur[a].dim, cur[a].chunks, zigzag=cur[a].zigzag))
        cur[a] = Replicate()

    for a in reversed(range(k)):
        s, d = cur[a], dst[a]
        if isinstance(s, Shard) and s != d:
            for b in reversed(_inner_sharding(cur, a, s.dim)):
                gather(b)
            diff = [b for b in range(k) if cur[b] != dst[b]]
            if (isinstance(d, Shard) and s.chunks == 1 and d.chunks == 1 and diff == [a]
                    and not _other_axes_shard(cur, a, s.dim) and not _other_axes_shard(cur, a, d.dim)):
                steps.append(Step("all_to_all", a, s.dim, 1, d.dim))
                cur[a] = d
                continue
            gather(a)
    for a in range(k):
        s, d = cur[a], dst[a]
        if isinstance(s, Partial) and not isinstance(d, Partial):
            if isinstance(d, Shard) and not _other_axes_shard(dst, a, d.dim) and not _other_axes_shard(cur, a, d.dim):
                steps.append(Step("reduce_scatter", a, d.dim, d.chunks, zigzag=d.zigzag))
                cur[a] = d
            else:
                steps.append(Step("all_reduce", a))
                cur[a] = Replicate()
    for a in range(k):
        s, d = cur[a], dst[a]
        if isinstance(s, Replicate) and isinstance(d, Shard):
            for b in reversed(_inner_sharding(cur, a, d.dim)):
                gather(b)
            steps.append(Step("local_slice", a, d.dim, d.chunks, zigzag=d.zigzag))
        elif isinstance(s, Replicate) and isinstance(d, Partial):
            steps.append(Step("to_partial", a))
        cur[a] = d
    return steps


def step_bytes(step: Step, local_bytes_before: float, mesh_shape) -> tuple[float, float]:
    """(bytes the collective moves as its full size, local bytes after the step)."""
    p = mesh_shape[step.axis]
    if step.kind == "all_gather":
        return local_bytes_before * p, local_bytes_before * p
    if step.kind == "reduce_scatter":
        return local_bytes_before, local_bytes_before / p
    if step.kind == "local_slice":
        return local_bytes_before, local_bytes_before / p  # its backward all-gathers the full size
    return (local_bytes_before if step.communicates else 0.0), local_bytes_before


_BWD = {"all_gather": "local_slice", "all_reduce": None, "reduce_scatter": "all_gather",
        "all_to_all": "all_to_all", "local_slice": "all_gather", "to_partial": None}


def backward_kind(kind: str) -> str | None:
    """The conjugate collective autograd runs for a forward step (None: nothing)."""
    return _BWD[kind]
