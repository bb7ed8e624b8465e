"""Resumable training: numbered checkpoints in one directory, the newest complete one found on start.

``CheckpointManager(directory, every=k, keep=n)`` is what a training script under
``torchrun --max-restarts`` needs (torchtitan's layout): ``resume(pmodel, opt)`` loads the newest
complete checkpoint (or none) and returns the step to start from; ``maybe_save(pmodel, opt, step)``
saves ``<directory>/step-<step>`` every k steps and then, on rank 0, deletes all but the newest n.

Completeness comes from ``pmodel.save`` itself (``runtime/checkpoint.py``): ranks write into
``step-<k>.tmp-<id>`` and rank 0 renames it to ``step-<k>`` only once every rank's data and the
``.metadata`` file are written. So ``step-<k>`` with a ``.metadata`` file is complete, and the
save that was running when a rank died left only a ``.tmp-<id>`` folder, which is skipped (and
deleted by the next save that passes its step). Rank 0 reads the directory and every rank loads
what it found, so all ranks resume from the same step.
"""
from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from autopar.core.errors import CheckpointError

PREFIX = "step-"
_COMPLETE = re.compile(rf"{PREFIX}(\d+)$")
_LEFTOVER = re.compile(rf"{PREFIX}(\d+)\.(?:tmp|old)-[0-9a-f]+$")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _entries(directory: Path) -> list[Path]:
    """The directory's entries; [] when it does not exist yet; a CheckpointError when it cannot be read."""
    if not directory.exists():
        return []
    if not directory.is_dir():
        raise CheckpointError(f"the checkpoint directory {directory} is a file; pass a directory (it is created on "
                              "the first save if missing)")
    try:
        return list(directory.iterdir())
    except OSError as e:
        raise CheckpointError(f"cannot list the checkpoint directory {directory}: {e.strerror or e}; give this "
                              "process read access to it, or pass another directory") from None


def complete_checkpoints(directory) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint under ``directory``, oldest first. A ``step-<k>``
    folder without ``.metadata`` (not written by ``pmodel.save``) is skipped with a warning."""
    out = []
    for p in _entries(Path(directory)):
        m = _COMPLETE.match(p.name)
        if not m or not p.is_dir():
            continue
        if not (p / ".metadata").is_file():
            warnings.warn(f"{p} is not a complete checkpoint (it has no .metadata file, which pmodel.save writes "
                          "last); skipping it", RuntimeWarning, stacklevel=2)
            continue
        out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(directory) -> Path | None:
    """The newest complete checkpoint under ``directory`` (highest step), or None when there is none."""
    found = complete_checkpoints(directory)
    return found[-1][1] if found else None


def check_restartable() -> None:
    """Raise when torchrun may restart this job's ranks (``--max-restarts`` > 0) into a process group
    they cannot form. torchrun (torch >= 2.5) gives the ranks its own rendezvous TCP store
    (``TORCHELASTIC_USE_AGENT_STORE=True``) and keeps it across restarts without scoping the keys
    to the attempt, so restarted ranks read the addresses their dead predecessors published
    (pytorch/pytorch#135712; measured: gloo "Connection refused" or a connect timeout on restart).
    With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` a c10d rendezvous makes a fresh store per attempt."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise RuntimeError(
            f"torchrun may restart this job (--max-restarts {restarts}) but shares its rendezvous store with the "
            "ranks (TORCHELASTIC_USE_AGENT_STORE=True) and keeps it across restarts: restarted ranks would read "
            "their dead predecessors' addresses and fail to form a process group. Launch torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment and a c10d rendezvous (--standalone on "
            "one machine, or --rdzv-backend c10d)")


def _whole(name: str, value, least: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"CheckpointManager: {name} must be a whole number >= {least}, got {value!r}")
    return value


@dataclass
class CheckpointManager:
    """Checkpoints ``step-<k>`` under ``directory``: saved every ``every`` steps, the newest ``keep`` kept."""

    directory: Path
    every: int
    keep: int = 2

    def __post_init__(self):
        if not isinstance(self.directory, (str, Path)):
            raise TypeError(f"CheckpointManager: directory must be a path, got {type(self.directory).__name__}")
        self.directory = Path(self.directory)
        self.every = _whole("every", self.every, 1)
        self.keep = _whole("keep", self.keep, 1)

    def path(self, step: int) -> Path:
        return self.directory / f"{PREFIX}{step}"

    def latest(self) -> Path | None:
        """The newest complete checkpoint, as rank 0 sees it, on every rank (one broadcast)."""
        box = [None, None]
        if _rank() == 0:
            try:
                found = latest_checkpoint(self.directory)
                box[0] = None if found is None else str(found)
            except CheckpointError as e:
                box[1] = str(e)
        if dist.is_available() and dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        if box[1]:
            raise CheckpointError(box[1])
        return None if box[0] is None else Path(box[0])

    def resume(self, pmodel, optimizer=None) -> int:
        """Load the newest complete checkpoint into ``pmodel`` (and ``optimizer``); return its step
        (the number of steps already done), or 0 when the directory holds none. Under torchrun it
        first checks that a restart could form its process group (``check_restartable``)."""
        check_restartable()
        found = self.latest()
        if found is None:
            return 0
        step = pmodel.load(found, optimizer=optimizer)
        return int(step) if step is not None else int(_COMPLETE.match(found.name).group(1))

    def maybe_save(self, pmodel, optimizer=None, step: int = 0, *, async_: bool = False):
        """After ``step`` steps are done: save ``step-<step>`` when ``step`` is a multiple of ``every``
        and prune (rank 0). Returns the path saved (a future of it with ``async_``), or None."""
        step = _whole("step", step, 0)
        if step == 0 or step % self.every:
            return None
        return self.save(pmodel, optimizer, step, async_=async_)

    def save(self, pmodel, optimizer=None, step: int = 0, *, async_: bool = False):
        """Save ``step-<step>`` now, then (rank 0) keep only the newest ``keep`` complete checkpoints
        and delete unfinished saves of steps up to ``step``."""
        step = _whole("step", step, 0)
        path = self.path(step)
        if not async_:
            pmodel.save(path, optimizer=optimizer, step=step)
            self._prune(step)
            return path
        saved = pmodel.save(path, optimizer=optimizer, step=step, async_=True)
        out: concurrent.futures.Future = concurrent.futures.Future()

        def prune_when_saved(f) -> None:       # ``out`` completes once the pruning is done too
            try:
                f.result()
                self._prune(step)
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on ``out``
                out.set_exception(e)
            else:
                out.set_result(path)

        saved.add_done_callback(prune_when_saved)
        return out

    def _prune(self, step: int) -> None:
        if _rank() != 0:
            return
        for _, p in complete_checkpoints(self.directory)[:-self.keep]:
            shutil.rmtree(p, ignore_errors=True)
        for p in _entries(self.directory):
            m = _LEFTOVER.match(p.name)
            if m and int(m.group(1)) <= step:     # a later step's save may be writing its own now
                shutil.rmtree(p, ignore_errors=True)
