"""Sharded checkpoints that reshard, through torch.distributed.checkpoint (DCP).

``save_checkpoint``: every rank writes only its own pieces of the model and of the optimizer state,
plus its RNG state; ``load_checkpoint``: every rank reads the pieces its plan gives it, whatever
plan and world size wrote them. Why it is built this way:

* **Pieces with global offsets, keyed by canonical name** (``checkpoint_state.py``). A rank's
  piece of a parameter is a product of index runs of the full tensor (``sharding/boxes.py``), so
  it is written as one or more boxes (several under ``Shard(dim, chunks)``, the fused-QKV layout,
  which a DTensor cannot express). DCP's metadata records every box; on load DCP intersects the
  boxes a rank needs with the boxes on disk and reads only the overlaps, so any plan reads any
  other plan's checkpoint and no rank ever holds a full tensor it does not own. Pieces go through
  DCP's ``_Checkpointable`` protocol with the default planners, and only the lookup of a piece is
  added; DCP's own dedup keeps one copy of each box that several ranks hold (replicas over data
  parallel axes, a tied embedding on two pipeline stages), and its plan validation refuses
  overlapping boxes or boxes that do not cover a tensor.
* **Optimizer state by parameter name, not position.** Parameter-shaped state (``exp_avg``,
  ``momentum_buffer``, ...) is written like its parameter, so it reshards the same way; scalars
  (``step``) as plain values (one copy kept). Under ZeRO the optimizer steps on flat shards: a
  shard holds a flat element range of the rank's piece, which ``flat_rects`` turns back into
  rectangles (views of the shard), so ZeRO state lands in another plan's pieces and back. The
  param groups (hyperparameters, parameters by name, gathered over ranks: a pipeline stage holds
  only some) and the optimizer's class go into the ``autopar`` entry; loading checks them first.
* **Checked before reading.** Loading first reads only the metadata and the ``autopar`` entry,
  checks shapes, names, the optimizer's kind and param groups, and every rank agrees on the
  problems (one small all-gather) before any data moves, so a bad checkpoint raises the same
  ``CheckpointError`` on every rank instead of a hang or a raw size mismatch.
* **Atomic.** All ranks write into ``<path>.tmp-<id>``; only when DCP has finished (every rank's
  data and the ``.metadata`` file written, fsynced) does rank 0 move the old checkpoint aside,
  rename the new one into place and delete the old. A save that fails on any rank (a full disk,
  a dead rank: DCP gathers the failures) never reaches the rename: the previous checkpoint stays.
  Between the two renames (microseconds) ``path`` is briefly absent; ``<path>.old-<id>`` holds it.
* **Async** (``async_=True``): the pieces are copied (staged) on the calling thread, then
  ``dcp.async_save`` writes them on a background thread over a separate gloo group (so its
  collectives never interleave with training's), and the rename runs after it; the returned
  future completes when the checkpoint is in place. The next save or load waits for it.
* **RNG**: each rank's torch (and CUDA) generator state; a rank restores the saved rank with its
  number (modulo the saved world size).

Not resharded: optimizer state that is neither parameter-shaped nor scalar (factored moments as
in Adafactor) is refused with a message. LR schedulers keep their own ``state_dict``.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import os
import shutil
import uuid
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager

from autopar.core.comm_timeout import comm_timeout_s, new_group, world_group
from autopar.core.errors import CheckpointError
from autopar.runtime.checkpoint_restore import Restore, rng_state
from autopar.runtime.checkpoint_state import (META, LoadPlanner, Pieces, SavePlanner, merge_optimizer_info,
                                              model_state, optimizer_state, optimizer_step, rng_key)

FORMAT = 1
_PENDING: list[concurrent.futures.Future] = []
_ASYNC: dict = {}       # the gloo group and thread of async saves, made on first use


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _world() -> int:
    return dist.get_world_size() if _dist() else 1


@contextlib.contextmanager
def _single_process(on: bool = True):
    """DCP warns whenever it runs without a process group; here that is meant (one process, or a
    rank reading a small entry alone)."""
    with warnings.catch_warnings():
        if on:
            warnings.filterwarnings("ignore", message="torch.distributed is .*unavailable or uninitialized")
        yield


def _all_gather(obj) -> list:
    if not _dist():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=world_group())
    return out


def _wait_pending() -> None:
    """A save or load waits for the async save before it (its future carries its own error)."""
    while _PENDING:
        concurrent.futures.wait([_PENDING.pop()])


# ---- saving ------------------------------------------------------------------------------------
def save_checkpoint(pmodel, path, optimizer=None, step: int | None = None, async_: bool = False):
    """Write this rank's pieces (module docstring). ``step``: the training step to record (default:
    the optimizer's ``step``). Returns None, or with ``async_`` a future of the path."""
    _wait_pending()
    path = Path(path)
    tmp = _make_tmp(path)
    try:
        state = _rank_state(pmodel, optimizer, step)
    except BaseException:
        _abandon(tmp)
        raise
    writer = FileSystemWriter(tmp, sync_files=True)
    if not async_:
        try:
            with _single_process(not _dist()):
                dcp.save(state, storage_writer=writer, planner=SavePlanner(), no_dist=not _dist(),
                         process_group=world_group() if _dist() else None)
        except (Exception, CheckpointException) as e:
            _abandon(tmp)
            raise _failed(path, e) from None
        _commit(tmp, path, world_group() if _dist() else None)
        return None
    group, pool = _async_resources()
    upload = dcp.async_save(_staged(state), storage_writer=writer, planner=SavePlanner(), process_group=group,
                            async_stager=_AlreadyStaged(), no_dist=not _dist())
    done = pool.submit(_finish_async, upload, tmp, path, group)
    _PENDING.append(done)
    return done


def _make_tmp(path: Path) -> Path:
    """Rank 0 checks ``path`` and makes the temporary directory; every rank gets its name or the error."""
    tmp, error = None, None
    if _rank() == 0:
        try:
            _check_replaceable(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:12]}")
            tmp.mkdir()
        except CheckpointError as e:
            error = str(e)
        except OSError as e:
            why = (f"{e.filename} is a file, not a directory" if isinstance(e, (FileExistsError, NotADirectoryError))
                   else f"{e.strerror or e} ({e.filename})")
            error = f"cannot write a checkpoint at {path}: {why}; save it under a directory this process can write"
    got = [str(tmp) if tmp else None, error]
    if _dist():
        dist.broadcast_object_list(got, src=0, group=world_group())
    if got[1]:
        raise CheckpointError(got[1])
    return Path(got[0])


def _check_replaceable(path: Path) -> None:
    if not path.exists():
        return
    if not path.is_dir():
        raise CheckpointError(f"cannot save a checkpoint at {path}: it is a file, and a checkpoint is a directory; "
                              "choose another path or remove the file")
    entries = {p.name for p in path.iterdir()}
    if entries and ".metadata" not in entries and "model.pt" not in entries:
        raise CheckpointError(f"cannot save a checkpoint at {path}: the directory exists and is not a checkpoint "
                              f"(no .metadata; it holds {len(entries)} entries), and saving replaces it; choose "
                              "another path or empty the directory")


def _rank_state(pmodel, optimizer, step) -> dict:
    state = model_state(pmodel)
    error, info = None, None
    if optimizer is not None:
        try:
            entries, info = optimizer_state(pmodel, optimizer)
            state.update(entries)
        except CheckpointError as e:
            error = str(e)
    gathered = _all_gather((error, info))          # every rank raises the same error, or none does
    errors = [e for e, _ in gathered if e]
    if errors:
        raise CheckpointError(errors[0])
    state[rng_key(_rank())] = rng_state()
    if _rank() == 0:
        plan = pmodel.plan
        if step is None and optimizer is not None:
            step = optimizer_step(optimizer)
        state[META] = {"format": FORMAT, "world_size": _world(), "mode": str(plan.mode), "degrees": plan.degrees,
                       "mesh": plan.mesh.to_dict(), "step": step,
                       "optimizer": merge_optimizer_info([i for _, i in gathered]) if optimizer is not None else None,
                       "loss_scaler": pmodel.scaler.state_dict() if pmodel.scaler is not None else None}
    return state


def _failed(path: Path, e: BaseException) -> CheckpointError:
    failures = getattr(e, "failures", None)
    if failures:
        reason = "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in sorted(failures.items()))
    else:
        reason = f"{type(e).__name__}: {e}"
    return CheckpointError(f"saving the checkpoint at {path} failed ({reason}); the previous checkpoint there, if "
                           "any, is unchanged; fix the cause (free space, permissions) and save again")


def _abandon(tmp: Path) -> None:
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def _commit(tmp: Path, path: Path, group) -> None:
    """Rank 0 puts the finished checkpoint in place of the previous one; every rank waits for it
    (rank 0 deletes the previous one after)."""
    old = None
    if _rank() == 0:
        if path.exists():
            old = path.with_name(f"{path.name}.old-{uuid.uuid4().hex[:12]}")
            os.replace(path, old)
        os.replace(tmp, path)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if _dist():
        dist.barrier(group=group)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---- async -------------------------------------------------------------------------------------
class _AlreadyStaged(AsyncStager):
    """``save_checkpoint`` stages the state itself (``_staged``: ``Pieces`` are autopar's)."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _staged(state: dict) -> dict:
    """A copy of the rank's state on the CPU that training can no longer change."""
    def copied(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", copy=True)

    out = {}
    for k, v in state.items():
        if isinstance(v, Pieces):
            out[k] = Pieces(v.global_size, [(off, copied(t)) for off, t in v.parts])
        elif isinstance(v, torch.Tensor):
            out[k] = copied(v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _async_resources():
    """The gloo group async saves coordinate over (not the training one; made with the communication timeout
    in force) and the thread that renames."""
    world = (dist.group.WORLD, comm_timeout_s()) if _dist() else None
    if _ASYNC.get("world") != world or "pool" not in _ASYNC:
        _ASYNC.update(world=world, group=new_group(backend="gloo") if _dist() else None,
                      pool=concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="autopar-ckpt"))
    return _ASYNC["group"], _ASYNC["pool"]


def _finish_async(upload: concurrent.futures.Future, tmp: Path, path: Path, group) -> str:
    try:
        upload.result()
    except (Exception, CheckpointException) as e:
        _abandon(tmp)
        raise _failed(path, e) from None
    _commit(tmp, path, group)
    return str(path)


# ---- loading -----------------------------------------------------------------------------------
def load_checkpoint(pmodel, path, optimizer=None) -> int | None:
    """Read this rank's pieces of a checkpoint saved under any plan; returns the recorded step."""
    _wait_pending()
    path = Path(path)
    metadata = _open(path)
    meta = {META: None}
    with _single_process():             # each rank reads this small entry alone
        dcp.load(meta, storage_reader=FileSystemReader(path), planner=LoadPlanner(), no_dist=True)
    meta = meta[META]
    found = meta.get("format") if isinstance(meta, dict) else None
    if not isinstance(found, int) or found > FORMAT:
        raise CheckpointError(f"the checkpoint at {path} has format {found}, which this autopar (format {FORMAT}) "
                              "cannot read; load it with the autopar that wrote it, or a newer one")
    restore = Restore(pmodel, str(path), metadata.state_dict_metadata, meta, _rank())
    restore.model()
    if optimizer is not None:
        restore.optimizer(optimizer)
    restore.rng()
    problems = []
    for ps in _all_gather(restore.problems):
        problems += [p for p in ps if p not in problems]
    if problems:
        raise CheckpointError("\n".join(problems))
    with _single_process(not _dist()):
        dcp.load(restore.template, storage_reader=FileSystemReader(path), planner=LoadPlanner(), no_dist=not _dist(),
                 process_group=world_group() if _dist() else None)
    restore.finish()
    if pmodel.scaler is not None and meta.get("loss_scaler"):      # fp16: the same on every rank
        pmodel.scaler.load_state_dict(meta["loss_scaler"])
    return meta.get("step")


def _open(path: Path):
    """The checkpoint's DCP metadata, or a CheckpointError saying why ``path`` is not a checkpoint."""
    if not path.exists():
        pending = sorted(p.name for p in path.parent.glob(f"{path.name}.tmp-*")) if path.parent.exists() else []
        hint = f" (an unfinished save left {pending[0]} beside it)" if pending else ""
        raise CheckpointError(f"no checkpoint at {path}: the path does not exist{hint}; pass the directory "
                              "pmodel.save wrote")
    if not path.is_dir():
        plain = path.suffix in (".pt", ".pth", ".bin", ".safetensors")
        raise CheckpointError(f"{path} is a file, not a checkpoint (pmodel.save writes a directory)"
                              + ("; a plain state dict file loads with pmodel.load_full_state_dict(path)" if plain
                                 else "; pass the directory pmodel.save wrote"))
    if not (path / ".metadata").exists():
        if (path / "model.pt").exists():
            raise CheckpointError(f"{path} is a checkpoint of autopar's earlier format (model.pt gathered on rank 0): "
                                  f"load its model with pmodel.load_full_state_dict(torch.load('{path / 'model.pt'}')"
                                  "['model']) and save it again")
        names = sorted(p.name for p in path.iterdir())
        raise CheckpointError(f"{path} is not a checkpoint: it has no .metadata file (it holds "
                              f"{', '.join(names[:5]) or 'nothing'}{' ...' if len(names) > 5 else ''}); pass the "
                              "directory pmodel.save wrote")
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:
        raise CheckpointError(f"the checkpoint at {path} is damaged: its .metadata cannot be read ({e}); load an "
                              "earlier checkpoint") from None
    if META not in metadata.state_dict_metadata:
        raise CheckpointError(f"{path} is a torch.distributed.checkpoint that pmodel.save did not write (no {META!r} "
                              "entry); load its tensors with torch.distributed.checkpoint and "
                              "pmodel.load_full_state_dict")
    return metadata
