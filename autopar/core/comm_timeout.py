"""The one communication timeout: how long any autopar collective or point-to-point wait may take.

It is, first found: the ``comm_timeout_s`` of the ``parallelize`` call being run (``using``), the
context's ``comm_timeout_s``, the timeout of the default process group (what the user passed to
``init_process_group``, or ``autopar.launch(timeout_s=)``), else ``DEFAULT_TIMEOUT_S``.

torch gives a group made by ``new_group`` torch's own default (30 min on gloo), not the default
group's timeout, so autopar makes every group it uses here: ``new_group`` and ``world_group``
carry the timeout, and ``device_mesh`` / ``span_groups`` build a mesh's groups with it.
"""
from __future__ import annotations

import contextlib
import datetime
import math

import torch
import torch.distributed as dist

from autopar.core.context import check_comm_timeout, get_auto_parallel_context

DEFAULT_TIMEOUT_S = 120.0       # the default group autopar initializes (launch, torchrun) when nothing is set
SETUP_WAIT_S = 1800.0           # how long set-up waits for a slower rank: planning on rank 0, making groups

_override: list[float | None] = [None]
_WORLD_GROUPS: dict = {}         # timeout (s) -> (the default group it spans, a group of every rank)


def group_timeout_s(group=None) -> float | None:
    """The timeout of ``group`` (default: the default group) in seconds, where torch exposes it; else None."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    group = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout.total_seconds()
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def comm_timeout_s() -> float:
    """The timeout in force (module docstring), in seconds."""
    for value in (_override[0], get_auto_parallel_context()["comm_timeout_s"], group_timeout_s()):
        if value is not None:
            return float(value)
    return DEFAULT_TIMEOUT_S


def comm_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=comm_timeout_s())


@contextlib.contextmanager
def using(seconds: float | None):
    """Make ``seconds`` the timeout while the block runs (None: leave it as it is)."""
    if seconds is None:
        yield
        return
    check_comm_timeout(seconds)
    old, _override[0] = _override[0], float(seconds)
    try:
        yield
    finally:
        _override[0] = old


def new_group(ranks=None, backend=None):
    """``torch.distributed.new_group`` with the timeout in force (a collective over every rank). Making it
    waits for the other ranks as long as set-up may take (``SETUP_WAIT_S``: a peer still building its
    module, slower than this rank under load, has not stalled); its operations then get the timeout in
    force (torch's ``_set_pg_timeout``)."""
    seconds = comm_timeout_s()
    group = dist.new_group(ranks=ranks, backend=backend,
                           timeout=datetime.timedelta(seconds=max(seconds, SETUP_WAIT_S)))
    if seconds < SETUP_WAIT_S and group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(datetime.timedelta(seconds=seconds), group)
    return group


def world_group(seconds: float | None = None):
    """A group of every rank with the timeout in force (or ``seconds``): the default group when its timeout
    is that one."""
    seconds = float(seconds) if seconds is not None else comm_timeout_s()
    world = dist.group.WORLD
    if group_timeout_s(world) in (None, seconds):
        return world
    spans, group = _WORLD_GROUPS.get(seconds, (None, None))
    if spans is not world:
        group = dist.new_group(list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=seconds))
        _WORLD_GROUPS[seconds] = (world, group)
    return group


def span_groups(shape: tuple, dims: tuple[int, ...]) -> tuple[object, list[int]]:
    """This rank's group over the ranks of a row-major mesh of ``shape`` that differ only on mesh
    dimensions ``dims`` (its ranks in mesh order), made with the timeout in force, and its ranks.
    Every rank creates every such group (``new_group`` is collective); all of them: the world group."""
    rank = dist.get_rank()
    grid = torch.arange(math.prod(shape)).reshape(shape)
    rest = [d for d in range(len(shape)) if d not in dims]
    rows = grid.permute(*rest, *dims).reshape(-1, math.prod(shape[d] for d in dims)).tolist()
    if len(rows) == 1:
        return world_group(), rows[0]
    mine = None
    for ranks in rows:
        group = new_group(ranks)
        if rank in ranks:
            mine = (group, ranks)
    return mine


def device_mesh(device_type: str, shape: tuple, names: tuple):
    """torch's DeviceMesh of ``shape`` over every rank, each dimension's groups made with the timeout in force
    (``init_device_mesh`` gives them torch's default instead)."""
    from torch.distributed.device_mesh import DeviceMesh

    groups = [span_groups(tuple(shape), (d,))[0] for d in range(len(shape))]
    grid = torch.arange(math.prod(shape)).reshape(tuple(shape))
    return DeviceMesh.from_group(groups, device_type, mesh=grid, mesh_dim_names=tuple(names))


__all__ = ["DEFAULT_TIMEOUT_S", "comm_timeout", "comm_timeout_s", "device_mesh", "group_timeout_s", "new_group",
           "span_groups", "using", "world_group"]
