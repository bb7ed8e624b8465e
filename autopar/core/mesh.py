"""Logical device mesh: shape, axis names, device spec; binds to torch's DeviceMesh when running."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class Mesh:
    """A logical grid of devices.

    ``Mesh(4)`` is one unnamed axis; ``Mesh((2, 2), axis_names=("dp", "tp"))`` a named 2-D mesh.
    An unnamed mesh may be re-factored by AUTO (e.g. 4 devices as dp=2 × tp=2).
    ``device`` names a preset of ``autopar.cost_models.devices`` used for planning costs
    (``devices.mesh_device(mesh)``).
    """

    shape: tuple
    axis_names: tuple | None = None
    device: str = "cpu"
    gpus_per_node: int | None = None
    memory_gb: float | None = None
    named: bool = field(default=True, repr=False)

    def __init__(self, shape, axis_names: Sequence[str] | None = None, device: str = "cpu",
                 gpus_per_node: int | None = None, memory_gb: float | None = None):
        shape = _check_shape(shape)
        self.named = axis_names is not None
        if axis_names is None:
            axis_names = tuple(f"d{i}" for i in range(len(shape)))
        if isinstance(axis_names, str):
            raise TypeError(f"Mesh(axis_names={axis_names!r}): give a tuple of names, one per axis, e.g. "
                            f"axis_names=({axis_names!r},)")
        axis_names = tuple(axis_names)
        if len(axis_names) != len(shape):
            raise ValueError(f"Mesh has {len(shape)} axes {shape} but {len(axis_names)} axis names {axis_names}")
        if len(set(axis_names)) != len(axis_names):
            raise ValueError(f"Mesh axis names must be unique, got {axis_names}")
        if memory_gb is not None and (not isinstance(memory_gb, numbers.Real) or not memory_gb > 0):
            raise ValueError(f"Mesh(memory_gb={memory_gb!r}): the per-device memory cap must be a number of GiB > 0, "
                             "e.g. memory_gb=80 (or leave it out to use the device preset's memory)")
        if gpus_per_node is not None and not _is_count(gpus_per_node):
            raise ValueError(f"Mesh(gpus_per_node={gpus_per_node!r}): must be a whole number >= 1, e.g. 8")
        self.shape = shape
        self.axis_names = axis_names
        self.device = device
        self.gpus_per_node = gpus_per_node
        self.memory_gb = memory_gb
        self._device_mesh = None

    # ---- facts -------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def axis_size(self, name: str) -> int:
        return self.shape[self.axis_index(name)]

    def axis_index(self, name: str) -> int:
        if name not in self.axis_names:
            raise ValueError(f"unknown mesh axis {name!r}; this mesh has axes {self.axis_names}")
        return self.axis_names.index(name)

    def coords(self, rank: int) -> tuple:
        """Coordinates of ``rank`` (row-major, last axis fastest)."""
        out = []
        for s in reversed(self.shape):
            out.append(rank % s)
            rank //= s
        return tuple(reversed(out))

    def reshape(self, shape, axis_names) -> "Mesh":
        if math.prod(shape) != self.size:
            raise ValueError(f"cannot reshape a mesh of {self.size} devices to {shape}")
        m = Mesh(shape, axis_names, self.device, self.gpus_per_node, self.memory_gb)
        m.named = any(n in ("dp", "tp", "pp", "cp") for n in m.axis_names)
        return m

    # ---- JSON --------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "axis_names": list(self.axis_names), "named": self.named,
                "device": self.device, "gpus_per_node": self.gpus_per_node, "memory_gb": self.memory_gb}

    @classmethod
    def from_dict(cls, d: dict) -> "Mesh":
        m = cls(tuple(d["shape"]), d["axis_names"] if d.get("named", True) else None, d.get("device", "cpu"),
                d.get("gpus_per_node"), d.get("memory_gb"))
        m.axis_names = tuple(d["axis_names"])
        return m

    def __eq__(self, other) -> bool:
        return isinstance(other, Mesh) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        axes = " × ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))
        return f"Mesh({axes}, device={self.device!r})"

    # ---- torch binding -----------------------------------------------------------------
    @classmethod
    def from_device_mesh(cls, device_mesh, device: str = "cpu") -> "Mesh":
        names = device_mesh.mesh_dim_names
        m = cls(tuple(device_mesh.mesh.shape), names, device)
        m._device_mesh = device_mesh
        return m

    def device_mesh(self):
        """torch's DeviceMesh over the default process group (created once, on first use), its groups made
        with the communication timeout in force (``autopar.core.comm_timeout``)."""
        import torch.distributed as dist

        from autopar.core.comm_timeout import device_mesh

        if self._device_mesh is None:
            if not dist.is_initialized():
                raise RuntimeError("no default process group: run under torchrun or autopar.launch, "
                                   "or call torch.distributed.init_process_group first")
            world = dist.get_world_size()
            if world != self.size:
                raise ValueError(f"mesh {self!r} has {self.size} devices but the process group has "
                                 f"{world} ranks; make the mesh size equal the world size (e.g. "
                                 f"autopar.Mesh({world})), or launch {self.size} processes")
            dev = "cpu" if dist.get_backend() == "gloo" else "cuda"
            self._device_mesh = device_mesh(dev, self.shape, self.axis_names)
        return self._device_mesh

    def group(self, axis: str):
        return self.device_mesh().get_group(axis)

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_device_mesh"] = None
        return d


def _is_count(n) -> bool:
    return isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 1


def _check_shape(shape) -> tuple:
    """``shape`` (a device count or a sequence of them) as a tuple of ints, or a ValueError saying what is wrong."""
    items = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    example = "e.g. Mesh(4) or Mesh((2, 2))"
    if not items:
        raise ValueError(f"Mesh({shape!r}): the shape names no axis; give a device count or one per axis, {example}")
    for i, n in enumerate(items):
        where = f"axis {i} " if len(items) > 1 else ""
        if not isinstance(n, numbers.Integral) or isinstance(n, bool):
            raise TypeError(f"Mesh({shape!r}): {where}size {n!r} is a {type(n).__name__}, not a whole number of "
                             f"devices; give an int or a tuple of ints, {example}")
        if n < 1:
            raise ValueError(f"Mesh({shape!r}): {where}size {n} has no devices; every axis needs at least 1 device, "
                             f"{example}")
    return tuple(int(n) for n in items)
