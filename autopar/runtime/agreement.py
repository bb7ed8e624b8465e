"""Agreement across ranks at start-up: every rank describes what it was started with (versions, mesh,
model, example inputs, plan, traced graph); one ``all_gather_object`` compares the descriptions, and
a mismatch raises ``RankMismatchError`` on every rank, naming the first differing rank and field,
instead of the hang or the wrong training that ranks running different jobs would give."""
from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist

from autopar.collectives.watch import note
from autopar.core.comm_timeout import world_group
from autopar.core.errors import RankMismatchError


def tensor_summary(tensors) -> list[str]:
    """"shape dtype" of each tensor (or repr of a non-tensor), in order."""
    return [f"{list(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else repr(t) for t in tensors]


def model_summary(model: torch.nn.Module) -> list[str]:
    """"name shape dtype" of every parameter and buffer."""
    return [f"{n} {list(t.shape)} {t.dtype}" for n, t in model.state_dict(keep_vars=True).items()
            if isinstance(t, torch.Tensor)]


def digest(value) -> str:
    """A short hash of ``repr(value)``: for fields too large to gather whole (a plan)."""
    return hashlib.sha1(repr(value).encode()).hexdigest()[:12]


RUN_FIELDS = ("mode", "mesh", "degrees", "nodes", "params", "inputs", "outputs", "microbatches", "schedule",
              "stages", "pipeline", "memory_options", "grad_compression", "optimizer", "fingerprint",
              "accumulation_trace")


def plan_digest(plan) -> str:
    """A digest of what a plan makes a rank run (layouts, mesh, schedule, memory options), not of
    what it predicts or how long it took to find: ranks that plan for themselves from the same
    graph agree on it though their solve times differ."""
    data = json.loads(plan.to_json())
    return digest({k: data.get(k) for k in RUN_FIELDS})


def _first_difference(ref, other, rank: int) -> str:
    if isinstance(ref, list) and isinstance(other, list):
        for i, (a, b) in enumerate(zip(ref, other)):
            if a != b:
                return f"entry {i}: {a!r} on rank 0, {b!r} on rank {rank}"
        return f"{len(ref)} entries on rank 0, {len(other)} on rank {rank}"
    return f"{ref!r} on rank 0, {other!r} on rank {rank}"


def check_agreement(fields: dict, when: str, group=None) -> None:
    """Compare ``fields`` (name -> a small value; gathered whole) with every other rank's; raise
    ``RankMismatchError`` on every rank when a rank differs from rank 0, naming the first such rank,
    the field and the first differing entry. ``when``: the moment, for the message ("before
    planning", ...); ``group``: the world group to gather over (default: the one with the
    communication timeout). A no-op without a process group of 2+ ranks."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return
    gathered: list = [None] * dist.get_world_size()
    note("all_gather_object", detail=f"of what each rank was started with ({when})")
    dist.all_gather_object(gathered, fields, group=group or world_group())
    for rank, other in enumerate(gathered[1:], start=1):
        for key, ref in gathered[0].items():
            if other.get(key) != ref:
                raise RankMismatchError(
                    f"ranks disagree {when}: rank {rank}'s {key} differs from rank 0's "
                    f"({_first_difference(ref, other.get(key), rank)}). Every rank must run the same script with "
                    "the same model, example inputs, mesh, plan and versions (check branches on the rank number, "
                    "random shapes and differing environments)")


__all__ = ["check_agreement", "digest", "model_summary", "plan_digest", "tensor_summary"]
