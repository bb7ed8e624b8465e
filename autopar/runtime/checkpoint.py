"""Checkpoints that reshard: the full model state (gathered, written by rank 0) and each
rank's optimizer state. Loading under another plan cuts the full state anew."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_checkpoint(pmodel, path, optimizer=None) -> None:
    path = Path(path)
    state = pmodel.full_state_dict()
    if _rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        torch.save({"model": state, "plan": pmodel.plan.to_json()}, path / "model.pt")
    if optimizer is not None:
        path.mkdir(parents=True, exist_ok=True)
        torch.save(optimizer.state_dict(), path / f"optim.rank{_rank()}.pt")
    if dist.is_initialized():
        dist.barrier()


def load_checkpoint(pmodel, path, optimizer=None) -> None:
    path = Path(path)
    f = path / "model.pt"
    if not f.exists():
        raise FileNotFoundError(f"no autopar checkpoint at {path} (missing {f.name})")
    data = torch.load(f, weights_only=False)
    pmodel.load_full_state_dict(data["model"])
    if optimizer is not None:
        of = path / f"optim.rank{_rank()}.pt"
        if not of.exists():
            raise FileNotFoundError(f"no optimizer state for rank {_rank()} at {of}; optimizer state reloads only "
                                    "under the same plan and world size")
        optimizer.load_state_dict(torch.load(of, weights_only=False))
