"""Resolve mesh-axis names to process groups while a per-rank program runs.

Per-rank graphs name axes as strings (``all_reduce(x, 'tp')``) so that ``pmodel.code`` reads
well; the running ParallelModule binds the names to its mesh's process groups.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch.distributed as dist

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


_DM_CACHE: dict = {}


def axis_groups(mesh) -> dict[str, AxisGroup]:
    """Process groups of every axis of ``mesh`` (DeviceMesh created once per mesh shape)."""
    key = (mesh.shape, mesh.axis_names)
    if mesh._device_mesh is None and key in _DM_CACHE:
        mesh._device_mesh = _DM_CACHE[key]
    dm = mesh.device_mesh()
    _DM_CACHE[key] = dm
    coords = mesh.coords(dist.get_rank())
    groups = {n: AxisGroup(n, dm.get_group(n), s, c) for n, s, c in zip(mesh.axis_names, mesh.shape, coords)}
    for g in groups.values():
        _NAMES[id(g.group)] = g.name
    _NAMES[id(dist.group.WORLD)] = "+".join(mesh.axis_names)
    return groups


_NAMES: dict[int, str] = {}


def group_name(group, default: str) -> str:
    """The mesh axis (or ``"a+b"``: axes) a process group spans, for counting collectives."""
    if group is None:
        group = dist.group.WORLD
    return _NAMES.get(id(group), default)
