"""``pmodel.save_pretrained``: the model as a Hugging Face checkpoint (safetensors, sharded with
``model.safetensors.index.json`` past ``max_shard_size``, and ``config.json``) that
``transformers``' ``from_pretrained`` loads, without any rank holding the whole model.

How: the file layout (which tensor goes into which file, at which offsets) follows from the
tensors' global shapes and dtypes alone, so rank 0 (the writer) writes each file's safetensors
header first and then streams the tensors one at a time: for each, it allocates the full tensor,
copies in its own boxes and receives every other box from the lowest rank holding it
(point-to-point; a box several ranks hold, a replica, is sent once), writes its bytes and drops it.
A rank so holds at most its pieces plus one full tensor (and its cast, with ``dtype=``); the
writer reports the most it held at once (``Export.peak_bytes``). Which rank sends which box
follows from every rank's box list (one small all-gather of offsets and sizes, no values).

Names: each tensor is written once under its first state-dict name (tied ``lm_head.weight`` and
``model.embed_tokens.weight``: the embedding, as Hugging Face does); ``prefix`` exports the
tensors under it with the prefix stripped (the Hugging Face model inside a wrapper) and picks that
submodule's config; ``rename`` maps a model name to the exported one (None: not exported).

Atomic: the writer fills ``<dir>.tmp-<id>`` (each file fsynced), then moves the previous export
aside, renames the new one into place and deletes the old. A failure on any rank (a full disk)
never reaches the rename, so the previous export stays, and every rank raises the same error.
"""
from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from autopar.core.comm_timeout import world_group
from autopar.core.errors import CheckpointError
from autopar.runtime.pieces import local_pieces, state_entries

WRITER = 0
EXPORT_FILES = re.compile(r"^(model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json|config\.json|"
                          r"generation_config\.json)$")
_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


@dataclass
class Export:
    """What ``save_pretrained`` wrote: the directory, its files (in order) and, on the writer, the
    most bytes it held at once for one tensor (the full tensor, a received box, a cast copy)."""

    directory: Path
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    peak_bytes: int = 0


@dataclass
class _Item:
    name: str           # canonical name (``StateEntry.name``)
    out: str            # the exported name
    shape: tuple
    dtype: torch.dtype  # as written
    src_dtype: torch.dtype
    extra: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def parse_size(size) -> int:
    """Bytes of ``max_shard_size``: an int, or a string like "5GB", "500MB", "10KiB" (Hugging Face's units)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)\s*", str(size), flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size={size!r} is not a size; pass bytes (int) or a string like '5GB' or '200MB'")
    unit = m.group(2).upper()
    base = 1024 if "I" in unit else 1000
    power = " KMGT".index(unit[0]) if unit[0] in "KMGT" else 0
    return int(float(m.group(1)) * base ** power)


def _items(pmodel, prefix, rename, dtype) -> list[_Item]:
    out, seen = [], set()
    for e in state_entries(pmodel):
        name = None
        for a in e.aliases:
            if rename is not None:
                name = rename(a)
            elif prefix is None or a.startswith(prefix):
                name = a[len(prefix or ""):]
            if name is not None:
                break
        if name is None:
            continue
        if name in seen:
            raise ValueError(f"two tensors would be exported as {name!r}; make rename= give each its own name")
        seen.add(name)
        cast = dtype if dtype is not None and e.dtype.is_floating_point else e.dtype
        out.append(_Item(e.name, name, e.shape, cast, e.dtype, e.extra))
    if not out:
        raise ValueError(f"nothing to export: no tensor of the model's state has a name under prefix={prefix!r}"
                         if prefix is not None else "nothing to export: the model has no state")
    return out


def _shards(items: list[_Item], limit: int) -> list[list[_Item]]:
    files: list[list[_Item]] = [[]]
    size = 0
    for it in items:
        if files[-1] and size + it.nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(it)
        size += it.nbytes
    return files


def _header(items: list[_Item]) -> bytes:
    head, at = {}, 0
    for it in items:
        head[it.out] = {"dtype": _CODES[it.dtype], "shape": list(it.shape), "data_offsets": [at, at + it.nbytes]}
        at += it.nbytes
    head["__metadata__"] = {"format": "pt"}
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _senders(pmodel, pieces) -> dict[str, list[tuple[int, tuple, tuple]]]:
    """Name -> (rank, offsets, sizes) of every distinct box, from the lowest rank holding it."""
    mine = {n: p.box_keys() for n, p in pieces.items()}
    every = [mine]
    if _dist():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine, group=world_group())
    out: dict[str, list] = {}
    for r, boxes in enumerate(every):
        for name, keys in boxes.items():
            have = out.setdefault(name, [])
            known = {(o, s) for _, o, s in have}
            have.extend((r, o, s) for o, s in keys if (o, s) not in known)
    return out


def _check_target(directory: Path) -> None:
    if not directory.exists():
        return
    if not directory.is_dir():
        raise CheckpointError(f"cannot export to {directory}: it is a file; choose a directory path")
    other = sorted(p.name for p in directory.iterdir() if not EXPORT_FILES.match(p.name))
    if other:
        shown = ", ".join(other[:5]) + (f" and {len(other) - 5} more" if len(other) > 5 else "")
        raise CheckpointError(f"cannot export to {directory}: it holds files that are not a Hugging Face export "
                              f"({shown}), and an export replaces the whole directory; choose another path or "
                              "move them")


def remember_configs(pmodel, model):
    """Keep, on ``pmodel``, the Hugging Face config of ``model`` and of its submodules (module path ->
    (config, class name)): what ``save_pretrained`` writes as ``config.json``. Reads no tensor."""
    found = {}
    for path, mod in model.named_modules():
        cfg = getattr(mod, "config", None)
        if cfg is not None and (hasattr(cfg, "to_json_file") or hasattr(cfg, "save_pretrained")):
            found[path] = (cfg, type(mod).__name__)
    object.__setattr__(pmodel, "_model_configs", found)
    return pmodel


def _config_of(pmodel, prefix, config):
    if config is False or config is None:
        return None
    if config is not True:
        return config
    found = getattr(pmodel, "_model_configs", {}).get((prefix or "").rstrip("."))
    if found is None:
        return None
    cfg, cls = found
    cfg = copy.deepcopy(cfg)
    if cls and hasattr(cfg, "architectures"):
        cfg.architectures = [cls]
    return cfg


def _write_config(cfg, tmp: Path) -> None:
    if hasattr(cfg, "to_json_file"):
        cfg.to_json_file(str(tmp / "config.json"))
    elif hasattr(cfg, "save_pretrained"):
        cfg.save_pretrained(str(tmp))
    else:
        raise TypeError(f"config= must be a Hugging Face config (with to_json_file), True or False; got "
                        f"{type(cfg).__name__}")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Writer:
    """Rank 0's side: assemble each tensor from its boxes and stream it into the open file; after an
    error it keeps receiving (so no sender hangs) but writes nothing."""

    def __init__(self):
        self.error: str | None = None
        self.peak = 0

    def tensor(self, it: _Item, pmodel, piece, senders, f) -> None:
        if it.extra:
            full = pmodel._extra_state[it.name].detach()
        else:
            full = torch.empty(it.shape, dtype=it.src_dtype)
            filled, held = 0, full.nbytes
            own = {(o, s): v for o, s, v in piece.boxes} if piece is not None else {}
            for r, o, s in senders.get(it.name, []):
                box = full[tuple(slice(a, a + n) for a, n in zip(o, s))]
                if r == _rank():
                    box.copy_(own[(o, s)])
                else:
                    buf = torch.empty(s, dtype=it.src_dtype)
                    held = max(held, full.nbytes + buf.nbytes)
                    dist.recv(buf, src=r)
                    box.copy_(buf)
                filled += box.numel()
            if filled != full.numel() and self.error is None:
                self.error = (f"the ranks' pieces of {it.name!r} cover {filled} of its {full.numel()} elements; "
                              "this plan's layout of it is not supported by save_pretrained")
            self.peak = max(self.peak, held)
        out = full if full.dtype == it.dtype else full.to(it.dtype)
        self.peak = max(self.peak, full.nbytes + (out.nbytes if out is not full else 0))
        if self.error is None and f is not None:
            flat = out.contiguous().reshape(-1)
            f.write(flat.view(torch.uint8).numpy().data if flat.numel() else b"")


def _send(it: _Item, piece, senders) -> None:
    if it.extra or piece is None:
        return
    own = {(o, s): v for o, s, v in piece.boxes}
    for r, o, s in senders.get(it.name, []):
        if r == _rank():
            dist.send(own[(o, s)].contiguous(), dst=WRITER)


def _agree(error: str | None) -> None:
    got = [error]
    if _dist():
        dist.broadcast_object_list(got, src=WRITER, group=world_group())
    if got[0]:
        raise CheckpointError(got[0])


def save_pretrained(pmodel, directory, *, max_shard_size="5GB", config=True, prefix: str | None = None,
                    rename: Callable | None = None, dtype: torch.dtype | None = None) -> Export:
    """Write the model as a Hugging Face checkpoint directory (module docstring)."""
    if prefix is not None and rename is not None:
        raise ValueError("pass prefix= or rename=, not both (rename can strip the prefix itself)")
    if dtype is not None and dtype not in _CODES:
        raise ValueError(f"dtype={dtype} cannot be written to safetensors; pass one of {sorted(map(str, _CODES))}")
    directory = Path(directory)
    limit = parse_size(max_shard_size)
    items = _items(pmodel, prefix, rename, dtype)
    files = _shards(items, limit)
    names = (["model.safetensors"] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    cfg = _config_of(pmodel, prefix, config)
    pieces = local_pieces(pmodel)
    senders = _senders(pmodel, pieces)
    writer = _rank() == WRITER
    tmp, error = None, None
    if writer:
        try:
            _check_target(directory)
            directory.parent.mkdir(parents=True, exist_ok=True)
            tmp = directory.with_name(f"{directory.name}.tmp-{uuid.uuid4().hex[:12]}")
            tmp.mkdir()
        except (CheckpointError, OSError) as e:
            error = str(e) if isinstance(e, CheckpointError) else \
                f"cannot export to {directory}: {e.strerror or e} ({e.filename}); choose a directory this process can write"
    _agree(error)
    w = _Writer()
    for fname, group in zip(names, files):
        if not writer:
            for it in group:
                _send(it, pieces.get(it.name), senders)
            continue
        f = None
        try:
            f = open(tmp / fname, "wb")
            f.write(_header(group))
        except OSError as e:
            w.error = w.error or f"writing {tmp / fname} failed: {e}"
        for it in group:
            try:
                w.tensor(it, pmodel, pieces.get(it.name), senders, f if w.error is None else None)
            except OSError as e:
                w.error = w.error or f"writing {tmp / fname} failed: {e}"
        if f is not None:
            try:
                f.flush()
                os.fsync(f.fileno())
                f.close()
            except OSError as e:
                w.error = w.error or f"writing {tmp / fname} failed: {e}"
    if writer and w.error is None:
        try:
            if len(files) > 1:
                index = {"metadata": {"total_size": sum(it.nbytes for it in items)},
                         "weight_map": {it.out: n for n, group in zip(names, files) for it in group}}
                (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            if cfg is not None:
                _write_config(cfg, tmp)
            for p in tmp.iterdir():
                _fsync(p)
            _commit(tmp, directory)
        except (OSError, TypeError) as e:
            w.error = f"{type(e).__name__}: {e}"
    if writer and w.error is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        w.error = (f"exporting to {directory} failed ({w.error}); the previous export there, if any, is unchanged; "
                   "fix the cause and save again")
    _agree(w.error)
    listed = names + (["model.safetensors.index.json"] if len(files) > 1 else []) + (["config.json"] if cfg else [])
    return Export(directory, listed, len(items), w.peak)


def _commit(tmp: Path, directory: Path) -> None:
    old = None
    if directory.exists():
        old = directory.with_name(f"{directory.name}.old-{uuid.uuid4().hex[:12]}")
        os.replace(directory, old)
    os.replace(tmp, directory)
    _fsync(directory.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
