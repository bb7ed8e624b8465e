"""Which parts of each model tensor this rank holds, as the checkpoint sees them: a parameter's ``Layout``
(its runs of the full tensor, and under ZeRO the flat range of its shard), the names the rank holds, the
tensor that holds each, and ``Pieces``, a rank's boxes of one tensor in DCP's protocol. Apart from
``runtime/checkpoint_state.py`` so that building and training a module does not import
torch.distributed.checkpoint: DCP's own types load with the first save or load."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from autopar.sharding.boxes import boxes, flat_rects, runs, slices

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem


class Pieces:
    """This rank's boxes of one full tensor (offsets in the full tensor, a view into the rank's
    tensor each), in DCP's ``_Checkpointable`` protocol: write items on save, chunks on load."""

    def __init__(self, size, parts: list[tuple[tuple, torch.Tensor]]):
        self.global_size = torch.Size(size)
        self.parts = [(torch.Size(o), t) for o, t in parts if t.numel()]

    def size(self) -> torch.Size:
        return self.global_size

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(off, t.size()),
                                                      properties=TensorProperties.create_from_tensor(t),
                                                      size=self.global_size))
                for off, t in self.parts]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(off, t.size()) for off, t in self.parts]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.index is not None and index.index < len(self.parts) and self.parts[index.index][0] == index.offset:
            return self.parts[index.index][1]
        for off, t in self.parts:
            if off == index.offset:
                return t
        raise ValueError(f"no piece of {index.fqn} at offsets {list(index.offset)} on this rank")


@dataclass
class Layout:
    """Where a rank's tensor of one parameter lies in the full tensor of ``shape``: ``held``
    (``boxes.runs``) for the piece the plan gives the rank; ``flat`` = (lo, hi, piece shape) when
    the tensor is a ZeRO shard holding elements ``[lo, hi)`` of that piece's flattening."""

    shape: tuple
    held: list
    flat: tuple | None = None

    def pieces(self, t: torch.Tensor) -> Pieces:
        t = t.detach()
        if self.flat is None:
            return Pieces(self.shape, [(g, t[slices(loc, s)]) for g, loc, s in boxes(self.held)])
        lo, hi, shape = self.flat
        parts = []
        for off, sizes, start in flat_rects(shape, lo, hi):
            rect = t[start - lo:start - lo + math.prod(sizes)].view(sizes)
            for g, loc, s in boxes(self.held, off, sizes):
                parts.append((g, rect[slices([a - b for a, b in zip(loc, off)], s)]))
        return Pieces(self.shape, parts)


def layout(pmodel, name: str, shard: bool) -> Layout:
    """``name``'s layout on this rank: its plan piece, or (``shard`` and ZeRO shards it) its ZeRO shard."""
    plan = pmodel.plan
    d = plan.params[name]
    held = runs(tuple(d.shape), d.spec, pmodel._coords, plan.mesh.shape)
    zero = pmodel._zero
    if shard and zero is not None and zero.handles(name):
        _, sp = zero.sharded[name]
        return Layout(tuple(d.shape), held, (sp.lo, min(sp.hi, sp.n), tuple(sp.shape)))
    return Layout(tuple(d.shape), held)


def held_names(pmodel) -> list[str]:
    """The canonical names of the parameters and buffers this rank holds that the model's state dict has."""
    keys = set(pmodel._state_keys)
    return [name for name, d in pmodel.plan.params.items()
            if d.kind != "constant" and pmodel.program.has(name) and (not keys or keys & set(d.aliases))]


def model_tensor(pmodel, name: str) -> tuple[torch.Tensor, Layout]:
    """The tensor holding this rank's part of ``name`` (written in place on load) and its layout:
    the program's piece; under ZeRO-1/2 the working piece; under ZeRO-3 the shard."""
    zero = pmodel._zero
    if zero is not None and zero.handles(name):
        if zero.stage == 3:
            return pmodel.program.local_tensor(name), layout(pmodel, name, shard=True)
        return zero.working(name), layout(pmodel, name, shard=False)
    return pmodel.program.local_tensor(name), layout(pmodel, name, shard=False)
