"""Local pieces of a model built on the meta device: where they live and how to fill them.

A model whose parameters and buffers are on the meta device is built by ``parallelize`` without any
weights: each rank allocates only its own pieces (``empty_piece``), uninitialized, on its run
device. They are filled afterwards from full tensors, one parameter at a time, by ``init_weights``
(``runtime/replay_init.py``) or a checkpoint reader: ``local_pieces`` says, for every tensor this
rank holds, which boxes of the full tensor it holds and where, and ``write_full`` copies those boxes
out of a full tensor (both in ``runtime/pieces.py``)."""
from __future__ import annotations

import torch

from autopar.frontend.trace import run_device
from autopar.runtime.pieces import local_pieces, refresh


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
        for piece in local_pieces(pmodel, everything=True).values():
            piece.tensor.zero_()
    refresh(pmodel)


def allocate_extra(extra: dict) -> dict:
    """The state kept whole on every rank (tensors no graph uses), allocated where it is meta."""
    return {k: empty_piece(v) if v.is_meta else v for k, v in extra.items()}


__all__ = ["allocate_extra", "check_all_meta", "empty_piece", "fill_zeros", "is_meta_model", "keep_meta_model",
           "run_device"]
