"""``pmodel.load_pretrained``: a Hugging Face checkpoint (or a torch state-dict file) into this
rank's pieces, each rank reading only the boxes it holds (``runtime/pieces.py``).

Sources: a directory with ``model.safetensors.index.json`` (sharded; only the files it lists),
``model.safetensors``, ``pytorch_model.bin`` or other ``*.safetensors`` files; or one file
(``.safetensors``, or ``.pt``/``.pth``/``.bin`` read by ``torch.load(mmap=True, weights_only=True)``).
Safetensors are read through ``safe_open(...).get_slice(name)[box]``: only the box's bytes.

Names: a checkpoint key ``k`` is the model's ``prefix + k`` (``prefix="inner."`` when the Hugging Face
model sits in a wrapper's ``inner``), or ``rename(k)`` (a callable; None drops the key). Tied names
(``lm_head.weight`` and ``model.embed_tokens.weight``) are one tensor: either key loads it, as
Hugging Face's safetensors keep only one of them. Values are cast to each local tensor's dtype
(a bf16 checkpoint into an fp32 model); a floating checkpoint tensor into an integer one is refused.

All or nothing: every key's presence, shape and dtype kind is checked first (from the files'
headers), every rank agrees on the outcome (one small all-gather), and only then are the pieces
read and copied, so a checkpoint of another model raises one ``CheckpointError`` naming every
missing, unexpected and mis-shaped key and leaves the module as it was. Optimizer state is not touched.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from autopar.core.comm_timeout import world_group
from autopar.core.errors import CheckpointError
from autopar.runtime.pieces import local_pieces, refresh, state_entries
from autopar.sharding.boxes import slices

SHOWN = 8       # names listed per kind of problem in an error
_FLOAT_CODES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


@dataclass
class LoadResult:
    """What ``load_pretrained(strict=False)`` left out: model keys the checkpoint lacks (kept as they
    were) and checkpoint keys the model lacks (ignored)."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


class _Checkpoint:
    """Checkpoint key -> (shape, is floating) and box reads, over safetensors files or a torch state dict."""

    def __init__(self, path: Path):
        self.path = path
        self._handles: dict[str, object] = {}
        self._plain: Mapping | None = None
        files, plain = _files(path)
        if plain is not None:
            try:
                state = torch.load(plain, map_location="cpu", mmap=True, weights_only=True)
            except Exception as e:
                raise CheckpointError(f"{plain} is not a state dict torch.load can memory-map "
                                      f"({type(e).__name__}: {e}); pass a torch.save'd dict of tensors, a "
                                      ".safetensors file or a Hugging Face checkpoint directory") from None
            if isinstance(state, Mapping) and "state_dict" in state and isinstance(state["state_dict"], Mapping):
                state = state["state_dict"]
            if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise CheckpointError(f"{plain} does not hold a flat dict of tensors (a state dict); save the state "
                                      "dict itself (torch.save(model.state_dict(), path))")
            self._plain = state
            return
        from safetensors import safe_open

        for f in files:
            handle = safe_open(str(f), framework="pt")
            for k in handle.keys():
                self._handles[k] = handle

    def keys(self) -> list[str]:
        return list(self._plain) if self._plain is not None else list(self._handles)

    def info(self, key: str) -> tuple[tuple, bool]:
        if self._plain is not None:
            t = self._plain[key]
            return tuple(t.shape), t.is_floating_point()
        sl = self._handles[key].get_slice(key)
        return tuple(sl.get_shape()), sl.get_dtype() in _FLOAT_CODES

    def read(self, key: str, offsets: tuple, sizes: tuple) -> torch.Tensor:
        """The box ``[offsets, offsets + sizes)`` of tensor ``key``, reading only it."""
        if self._plain is not None:
            return self._plain[key][slices(offsets, sizes)]
        handle = self._handles[key]
        if not sizes:
            return handle.get_tensor(key)
        return handle.get_slice(key)[slices(offsets, sizes)]


def _files(path: Path) -> tuple[list[Path], Path | None]:
    """(safetensors files, or a torch state-dict file) of a checkpoint path."""
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: the path does not exist; pass a Hugging Face checkpoint "
                              "directory (model.safetensors, or shards with model.safetensors.index.json) or a "
                              "state-dict file")
    if path.is_file():
        return ([path], None) if path.suffix == ".safetensors" else ([], path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a safetensors index (a JSON object with a 'weight_map'): "
                                  f"{type(e).__name__}: {e}") from None
        names = sorted(set(weight_map.values()))
        absent = [n for n in names if not (path / n).exists()]
        if absent:
            raise CheckpointError(f"{index} lists {len(absent)} file(s) that are not in {path}: {_listing(absent)}; "
                                  "copy the whole checkpoint directory")
        return [path / n for n in names], None
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"], None
    if (path / "pytorch_model.bin").exists():
        return [], path / "pytorch_model.bin"
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} holds no model.safetensors, model.safetensors.index.json, pytorch_model.bin "
                              "or other .safetensors file; pass a Hugging Face checkpoint directory or a state-dict "
                              "file")
    return files, None


def _listing(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def _model_key(key: str, prefix: str | None, rename: Callable | None) -> str | None:
    if rename is not None:
        return rename(key)
    return (prefix or "") + key


def _hint(missing: list[str], unexpected: list[str]) -> str:
    """A name mapping that would match a missing model key to an unexpected checkpoint key."""
    for m in missing:
        for u in unexpected:
            if m.endswith("." + u) or (m.endswith(u) and m != u):
                return f"; the model's names carry a prefix the checkpoint's lack: pass prefix={m[:-len(u)]!r}"
            if u.endswith("." + m):
                cut = u[:-len(m)]
                return (f"; the checkpoint's names carry a prefix the model's lack: pass "
                        f"rename=lambda k: k.removeprefix({cut!r})")
    return ""


def plan_load(pmodel, ckpt: _Checkpoint, prefix, rename, strict: bool):
    """(entry -> checkpoint key, LoadResult), or a CheckpointError's message naming every problem."""
    by_model: dict[str, str] = {}
    for k in ckpt.keys():
        m = _model_key(k, prefix, rename)
        if m is not None:
            by_model.setdefault(m, k)
    chosen, missing, bad_shape, bad_kind, used = {}, [], [], [], set()
    for e in state_entries(pmodel):
        present = [a for a in e.aliases if a in by_model]
        used.update(present)
        if not present:
            missing.append(e.aliases[0])
            continue
        key = by_model[present[0]]
        shape, floating = ckpt.info(key)
        if shape != e.shape:
            bad_shape.append(f"{key!r} is {list(shape)} in the checkpoint but {list(e.shape)} in the model")
        elif floating and not (e.dtype.is_floating_point or e.dtype.is_complex):
            bad_kind.append(f"{key!r} is floating point in the checkpoint but {e.dtype} in the model")
        else:
            chosen[e.name] = (e, key)
    unexpected = sorted(m for m in by_model if m not in used)
    problems = []
    if missing and strict:
        problems.append(f"{len(missing)} model tensor(s) missing from the checkpoint: {_listing(missing)}")
    if unexpected and strict:
        problems.append(f"{len(unexpected)} checkpoint tensor(s) the model does not have: "
                        f"{_listing([by_model[u] for u in unexpected])}")
    if bad_shape:
        problems.append(f"{len(bad_shape)} tensor(s) of another shape (a model of another configuration: "
                        f"vocabulary, hidden size, ...): " + "; ".join(bad_shape[:SHOWN])
                        + (f"; and {len(bad_shape) - SHOWN} more" if len(bad_shape) > SHOWN else ""))
    if bad_kind:
        problems.append(f"{len(bad_kind)} tensor(s) of another kind: " + "; ".join(bad_kind[:SHOWN]))
    if problems:
        hint = _hint(missing, unexpected) if missing and unexpected else ""
        names = "" if prefix is None and rename is None else \
            f" (checkpoint names mapped by {'rename' if rename is not None else f'prefix={prefix!r}'})"
        return None, (f"cannot load {ckpt.path} into this model{names}: " + "; ".join(problems) + hint
                      + "; the module is unchanged. Build the model of that checkpoint, or map the names with "
                        "prefix= / rename=, or pass strict=False to skip missing and unexpected keys")
    return chosen, LoadResult(missing if not strict else [], [by_model[u] for u in unexpected] if not strict else [])


def _agree(error: str | None) -> None:
    """Every rank raises the first rank's error, or none does."""
    errors = [error]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error, group=world_group())
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)


def load_pretrained(pmodel, path, *, prefix: str | None = None, rename: Callable | None = None,
                    strict: bool = True) -> LoadResult:
    """Read this rank's pieces of every tensor from the checkpoint at ``path`` (module docstring)."""
    if prefix is not None and rename is not None:
        raise ValueError("pass prefix= or rename=, not both (rename can add the prefix itself)")
    error, chosen, result, ckpt = None, None, None, None
    try:
        ckpt = _Checkpoint(Path(path))
        chosen, result = plan_load(pmodel, ckpt, prefix, rename, strict)
        if chosen is None:
            error = result
    except CheckpointError as e:
        error = str(e)
    _agree(error)
    pieces = local_pieces(pmodel)
    with torch.no_grad():
        for name, (entry, key) in chosen.items():
            if entry.extra:
                old = pmodel._extra_state[name]
                pmodel._extra_state[name] = ckpt.read(key, (0,) * len(entry.shape), entry.shape).to(old.dtype).clone()
                continue
            piece = pieces.get(name)
            if piece is None:
                continue               # another pipeline stage's tensor
            for offsets, sizes, view in piece.boxes:
                view.copy_(ckpt.read(key, offsets, sizes))
    refresh(pmodel)
    return result
