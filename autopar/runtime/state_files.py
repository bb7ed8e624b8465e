"""Plain (single-device) state dicts on disk, read piece by piece: ``open_state_dict`` opens a
``torch.save`` file memory-mapped or safetensors files lazily (values are tensors or safetensors
slices that read nothing until indexed), and ``read_piece`` reads only this rank's boxes of one
tensor (``sharding/boxes.py``). So a Hugging Face checkpoint loads into any plan without any rank
holding the whole model, or even one whole tensor it only holds a piece of."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from autopar.core.errors import CheckpointError
from autopar.sharding.boxes import boxes, runs, slices

PLAIN = (".pt", ".pth", ".bin")


class _Safetensors(Mapping):
    """Tensor name -> its safetensors slice, over one file or a directory of shards."""

    def __init__(self, files: list[Path]):
        from safetensors import safe_open

        self._where = {}
        for f in files:
            handle = safe_open(str(f), framework="pt")
            for k in handle.keys():
                self._where[k] = handle

    def __getitem__(self, key):
        return self._where[key].get_slice(key)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def open_state_dict(path) -> Mapping:
    """A state dict file (``torch.save``: .pt/.pth/.bin; or .safetensors) or a directory of
    safetensors shards, opened without reading its tensors."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path} holds no .safetensors files; pass a state dict file (torch.save or "
                                  "safetensors) or a directory of safetensors shards")
        return _Safetensors(files)
    if not path.exists():
        raise CheckpointError(f"no state dict at {path}: the path does not exist")
    if path.suffix == ".safetensors":
        return _Safetensors([path])
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path} is not a state dict file torch.load can memory-map ({type(e).__name__}: {e}); "
                              "pass a torch.save'd dict of tensors or a .safetensors file") from None
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path} does not hold a flat dict of tensors (a state dict); pass the state dict "
                              "itself (e.g. torch.load(path)['model'])")
    return state


def shape_of(src) -> tuple:
    return tuple(src.get_shape()) if hasattr(src, "get_shape") else tuple(src.shape)


def read_piece(src, spec, coords, mesh_shape) -> torch.Tensor:
    """This rank's piece of the full tensor ``src`` (a tensor, memory-mapped or not, or a safetensors
    slice) under ``spec``: only its boxes are read."""
    shape = shape_of(src)
    held = runs(shape, spec, coords, mesh_shape)
    found = boxes(held)
    if len(found) == 1 and found[0][2] == shape and isinstance(src, torch.Tensor):
        return src
    reads = [(loc, s, src[slices(g, s)]) for g, loc, s in found]
    dtype = reads[0][2].dtype if reads else getattr(src, "dtype", torch.float32)
    out = torch.empty([sum(n for _, n in r) for r in held], dtype=dtype)
    for loc, s, part in reads:
        out[slices(loc, s)] = part
    return out

