"""What each rank holds of the model's full state, as boxes of the full tensors: what
``load_pretrained`` reads and ``save_pretrained`` gathers (``runtime/pretrained_load.py``,
``runtime/pretrained_save.py``).

``state_entries``: every entry of the model's state dict, once per tensor (tied names together,
in state-dict order), with its global shape and dtype, whether or not this rank holds any of it.
``local_pieces``: for each tensor this rank holds, the tensor written in place (the program's
piece; under ZeRO-1/2 the working piece; under ZeRO-3 the flat shard) and its boxes: (offsets in
the full tensor, sizes, a view of the rank's tensor); ``write_full`` copies those boxes out of a
full tensor (``init_weights``), ``refresh`` re-derives what depends on the pieces. A ZeRO-3 shard holds a flat range of the
plan's piece, cut into rectangles (``sharding/boxes.flat_rects``), so reading one reads only its
rows. A pipeline stage holds only its layers' tensors. Nothing here reads a tensor's values: a
module whose pieces are allocated but not initialized works the same.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.runtime.held_state import held_names, model_tensor
from autopar.sharding.boxes import slices


@dataclass(frozen=True)
class StateEntry:
    """One tensor of the model's state: ``name`` (the plan's canonical name, or the state-dict key of
    a tensor no stage holds), ``aliases`` (its state-dict keys, tied names together, in state-dict
    order), global ``shape`` and ``dtype``; ``extra``: a tensor no program holds, kept whole on every
    rank (``pmodel._extra_state``)."""

    name: str
    aliases: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    extra: bool = False


@dataclass
class LocalPiece:
    """This rank's part of one tensor: the full tensor's ``shape``, ``tensor`` (written in place: a
    plan piece or a ZeRO flat shard) and its ``boxes``, each (global offsets, sizes, view of
    ``tensor``); ``full[slices(offsets, sizes)]`` is what the view holds."""

    name: str
    shape: tuple
    tensor: torch.Tensor
    boxes: list[tuple[tuple, tuple, torch.Tensor]]

    def box_keys(self) -> list[tuple[tuple, tuple]]:
        return [(tuple(o), tuple(s)) for o, s, _ in self.boxes]


def state_entries(pmodel) -> list[StateEntry]:
    """Every tensor of the model's state dict (tied names as one entry), in state-dict order."""
    keys = list(pmodel._state_keys)
    order = {k: i for i, k in enumerate(keys)}
    extra = pmodel._extra_state
    out: list[StateEntry] = []
    covered: set[str] = set()
    for name, d in pmodel.plan.params.items():
        if d.kind == "constant" or all(a in extra for a in d.aliases):
            continue
        aliases = tuple(a for a in d.aliases if not keys or a in order)
        if not aliases:
            continue          # a non-persistent buffer: not in the state dict
        aliases = tuple(sorted(aliases, key=lambda a: order.get(a, 0)))
        out.append(StateEntry(name, aliases, tuple(d.shape), getattr(torch, d.dtype)))
        covered.update(aliases)
    for k, v in extra.items():
        if k not in covered and (not keys or k in order):
            out.append(StateEntry(k, (k,), tuple(v.shape), v.dtype, extra=True))
    return sorted(out, key=lambda e: order.get(e.aliases[0], len(order)))


def local_pieces(pmodel, everything: bool = False) -> dict[str, LocalPiece]:
    """Canonical name -> this rank's ``LocalPiece``, for every state tensor a program of this rank
    holds; ``everything``: also the tensors outside the state dict (non-persistent buffers) and the
    state kept whole on every rank (``pmodel._extra_state``, under its state-dict name)."""
    out = {}
    names = [n for n, d in pmodel.plan.params.items() if d.kind != "constant" and pmodel.program.has(n)] \
        if everything else held_names(pmodel)
    for name in names:
        t, lay = model_tensor(pmodel, name)
        out[name] = LocalPiece(name, tuple(lay.shape), t, [(tuple(o), tuple(v.shape), v) for o, v in lay.pieces(t).parts])
    if everything:
        for key, t in pmodel._extra_state.items():
            out.setdefault(key, LocalPiece(key, tuple(t.shape), t, [((0,) * t.dim(), tuple(t.shape), t)]))
    return out


def write_full(piece: LocalPiece, full: torch.Tensor) -> None:
    """Copy this rank's boxes of ``full`` (the whole tensor, any device) into its tensor."""
    if tuple(full.shape) != tuple(piece.shape):
        raise ValueError(f"{piece.name}: a full tensor of shape {list(full.shape)} given for a tensor of shape "
                         f"{list(piece.shape)}")
    with torch.no_grad():
        for offsets, sizes, view in piece.boxes:
            view.copy_(full[slices(offsets, sizes)])


def refresh(pmodel) -> None:
    """After writing the pieces: ZeRO-1/2 re-cut their master shards from the working pieces."""
    zero = pmodel._zero
    if zero is not None:
        zero.refresh_shards()
