"""Resolve mesh-axis names to process groups while a per-rank program runs.

Per-rank graphs name axes as strings (``all_reduce(x, 'tp')``) so that ``pmodel.code`` reads
well; the running ParallelModule binds the names to its mesh's process groups.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch.distributed as dist

from autopar.core.comm_timeout import comm_timeout_s, span_groups, world_group

_local = threading.local()


@dataclass(frozen=True)
class AxisGroup:
    name: str
    group: object       # ProcessGroup
    size: int
    rank: int           # this rank's index along the axis


def _stack() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


@contextlib.contextmanager
def bound_axes(axes: dict[str, AxisGroup]):
    """Bind axis names to groups for the duration of a forward (backward captures them)."""
    _stack().append(axes)
    try:
        yield
    finally:
        _stack().pop()


def axis(name: str) -> AxisGroup:
    stack = _stack()
    if not stack:
        raise RuntimeError(f"collective on mesh axis {name!r} outside a ParallelModule: no process groups bound")
    try:
        return stack[-1][name]
    except KeyError:
        raise RuntimeError(f"mesh axis {name!r} is not bound; bound axes: {sorted(stack[-1])}") from None


def current_axes() -> dict[str, AxisGroup] | None:
    """The axes bound now (None outside a ParallelModule's forward); recomputation re-binds them."""
    stack = _stack()
    return stack[-1] if stack else None


_DM_CACHE: dict = {}        # (shape, axis names, timeout) -> (the default group then, DeviceMesh)
_SPANS: dict = {}           # (shape, axis names, dims, timeout) -> (the default group then, group)


def axis_groups(mesh) -> dict[str, AxisGroup]:
    """Process groups of every axis of ``mesh`` (DeviceMesh created once per mesh shape and communication
    timeout, its groups made with that timeout)."""
    key = (mesh.shape, mesh.axis_names, comm_timeout_s())
    world, cached = _DM_CACHE.get(key, (None, None))
    if mesh._device_mesh is None and world is dist.group.WORLD:
        mesh._device_mesh = cached
    dm = mesh.device_mesh()
    _DM_CACHE[key] = (dist.group.WORLD, dm)
    coords = mesh.coords(dist.get_rank())
    groups = {n: AxisGroup(n, dm.get_group(n), s, c) for n, s, c in zip(mesh.axis_names, mesh.shape, coords)}
    for g in groups.values():
        _NAMES[id(g.group)] = g.name
    for world in (dist.group.WORLD, world_group()):
        _NAMES[id(world)] = "+".join(mesh.axis_names)
    return groups


_NAMES: dict[int, str] = {}


def span_group(mesh, axes) -> object:
    """The process group over the ranks that differ from this one only on the mesh ``axes`` (names; all of
    them: every rank), made once per mesh, axes and timeout with the communication timeout in force."""
    dims = tuple(i for i, n in enumerate(mesh.axis_names) if n in axes)
    key = (mesh.shape, mesh.axis_names, dims, comm_timeout_s())
    world, group = _SPANS.get(key, (None, None))
    if world is not dist.group.WORLD:
        group = span_groups(tuple(mesh.shape), dims)[0]
        _SPANS[key] = (dist.group.WORLD, group)
    _NAMES.setdefault(id(group), "+".join(mesh.axis_names[d] for d in dims))
    return group


def group_name(group, default: str) -> str:
    """The mesh axis (or ``"a+b"``: axes) a process group spans, for counting collectives."""
    if group is None:
        group = dist.group.WORLD
    return _NAMES.get(id(group), default)
