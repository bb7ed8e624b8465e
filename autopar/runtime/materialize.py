"""Local pieces of a model built on the meta device: where they live and how to fill them.

A model whose parameters and buffers are on the meta device is built by ``parallelize`` without any
weights: each rank allocates only its own pieces (``empty_piece``), uninitialized, on its run
device. They are filled afterwards from full tensors, one parameter at a time, by ``init_weights``
(``runtime/replay_init.py``) or a checkpoint reader: ``local_pieces`` says, for every tensor this
rank holds, which boxes of the full tensor it holds and where (views into the rank's storage), and
``write_full`` copies those boxes out of a full tensor. ``finish`` then refreshes what is derived
from the pieces (ZeRO-1/2 master shards)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.runtime.checkpoint_state import model_tensor
from autopar.sharding.boxes import slices
from autopar.frontend.trace import run_device


def empty_piece(meta_piece: torch.Tensor) -> torch.Tensor:
    """A real, uninitialized tensor shaped like ``meta_piece`` (a meta tensor) on the run device."""
    return torch.empty(meta_piece.shape, dtype=meta_piece.dtype, device=run_device())


def is_meta_model(model: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


def check_all_meta(model: torch.nn.Module) -> None:
    """A meta model has every parameter and buffer on the meta device (a mix cannot be built)."""
    real = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if not t.is_meta]
    if real:
        raise ValueError(f"the model has tensors on the meta device and others not ({', '.join(real[:5])}"
                         f"{', ...' if len(real) > 5 else ''} are real): build the whole model under "
                         "torch.device('meta') (then pmodel.init_weights() or a checkpoint fills it), or build it "
                         "for real")


def keep_meta_model(pmodel, model: torch.nn.Module) -> None:
    """Remember the meta model ``pmodel`` was built from (no memory: it holds no data), for ``init_weights``."""
    object.__setattr__(pmodel, "_meta_model", model)


def fill_zeros(pmodel) -> None:
    """Zeros in every piece (a module that is only timed, e.g. by autotune, needs finite values)."""
    with torch.no_grad():
        for piece in local_pieces(pmodel).values():
            piece.storage.zero_()
    finish(pmodel)


@dataclass
class LocalPiece:
    """One tensor this rank holds: ``name`` (the plan's canonical name), the full tensor's ``shape``,
    ``storage`` (the tensor that holds this rank's part: a plan piece, or a ZeRO flat shard) and
    ``boxes``: (global offsets, view into ``storage``) for every box of the full tensor it holds;
    ``full[slices(offsets, view.shape)]`` is what the view holds."""

    name: str
    shape: tuple
    storage: torch.Tensor
    boxes: list


def local_pieces(pmodel) -> dict[str, LocalPiece]:
    """Every parameter and buffer this rank holds (canonical names; a tensor no rank's graph uses is
    held whole, under its state-dict name)."""
    out = {}
    for name, d in pmodel.plan.params.items():
        if d.kind == "constant" or not pmodel.program.has(name):
            continue
        t, lay = model_tensor(pmodel, name)
        out[name] = LocalPiece(name, lay.shape, t, [(g, v) for g, v in lay.pieces(t).parts])
    for key, t in pmodel._extra_state.items():
        out.setdefault(key, LocalPiece(key, tuple(t.shape), t, [((0,) * t.dim(), t)]))
    return out


def write_full(piece: LocalPiece, full: torch.Tensor) -> None:
    """Copy this rank's boxes of ``full`` (the whole tensor, any device) into its storage."""
    if tuple(full.shape) != tuple(piece.shape):
        raise ValueError(f"{piece.name}: a full tensor of shape {list(full.shape)} given for a tensor of shape "
                         f"{list(piece.shape)}")
    with torch.no_grad():
        for g, view in piece.boxes:
            view.copy_(full[slices(g, view.shape)])


def finish(pmodel) -> None:
    """After the pieces were written: ZeRO-1/2 master shards copied from the working pieces."""
    if pmodel._zero is not None:
        pmodel._zero.refresh_shards()


def allocate_extra(extra: dict) -> dict:
    """The state kept whole on every rank (tensors no graph uses), allocated where it is meta."""
    return {k: empty_piece(v) if v.is_meta else v for k, v in extra.items()}


__all__ = ["LocalPiece", "allocate_extra", "check_all_meta", "empty_piece", "fill_zeros", "finish", "is_meta_model",
           "keep_meta_model", "local_pieces", "run_device", "write_full"]
