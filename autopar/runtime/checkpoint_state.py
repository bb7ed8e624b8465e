"""One rank's checkpoint state for torch.distributed.checkpoint (DCP): its pieces of every model
tensor and every optimizer-state tensor, keyed by canonical parameter name, each piece with its
offsets in the full tensor, so that DCP reshards on load (``runtime/checkpoint.py`` says why).

Keys (one flat dict; DCP's own flattening is off):
    ``model.<name>``                a parameter or buffer (``Pieces``), or a state entry no stage
                                    holds (a plain tensor, the same on every rank)
    ``optim.state.<name>.<key>``    optimizer state: a parameter-shaped tensor (``Pieces``, also
                                    under ZeRO, whose flat shards map back to element ranges), or a
                                    scalar (``step``: a plain tensor or Python value)
    ``autopar``                     a dict rank 0 writes: format, world size, plan summary, step, and
                                    the optimizer's class, param groups (by name) and state keys
    ``rng.rank<r>``                 rank r's torch RNG states

A piece is described by ``Layout``: the runs of the full tensor the rank's piece holds
(``sharding/boxes.py``), and under ZeRO the flat range of that piece the rank's shard holds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from autopar.core.errors import CheckpointError
from autopar.runtime import idle_rank
from autopar.sharding.boxes import boxes, flat_rects, runs, slices

MODEL, OPTIM, META = "model.", "optim.state.", "autopar"


def rng_key(rank: int) -> str:
    return f"rng.rank{rank}"


class Pieces:
    """This rank's boxes of one full tensor (offsets in the full tensor, a view into the rank's
    tensor each), in DCP's ``_Checkpointable`` protocol: write items on save, chunks on load."""

    def __init__(self, size, parts: list[tuple[tuple, torch.Tensor]]):
        self.global_size = torch.Size(size)
        self.parts = [(torch.Size(o), t) for o, t in parts if t.numel()]

    def size(self) -> torch.Size:
        return self.global_size

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(off, t.size()),
                                                      properties=TensorProperties.create_from_tensor(t),
                                                      size=self.global_size))
                for off, t in self.parts]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(off, t.size()) for off, t in self.parts]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.index is not None and index.index < len(self.parts) and self.parts[index.index][0] == index.offset:
            return self.parts[index.index][1]
        for off, t in self.parts:
            if off == index.offset:
                return t
        raise ValueError(f"no piece of {index.fqn} at offsets {list(index.offset)} on this rank")


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner (replicated pieces deduplicated) that knows ``Pieces``."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Pieces) else super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that knows ``Pieces``. Its ``set_up_planner`` is replaced: the
    default one turns values it does not know (``Pieces``) into None while looking for meta tensors."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Pieces) else super().lookup_tensor(index)


@dataclass
class Layout:
    """Where a rank's tensor of one parameter lies in the full tensor of ``shape``: ``held``
    (``boxes.runs``) for the piece the plan gives the rank; ``flat`` = (lo, hi, piece shape) when
    the tensor is a ZeRO shard holding elements ``[lo, hi)`` of that piece's flattening."""

    shape: tuple
    held: list
    flat: tuple | None = None

    def pieces(self, t: torch.Tensor) -> Pieces:
        t = t.detach()
        if self.flat is None:
            return Pieces(self.shape, [(g, t[slices(loc, s)]) for g, loc, s in boxes(self.held)])
        lo, hi, shape = self.flat
        parts = []
        for off, sizes, start in flat_rects(shape, lo, hi):
            rect = t[start - lo:start - lo + math.prod(sizes)].view(sizes)
            for g, loc, s in boxes(self.held, off, sizes):
                parts.append((g, rect[slices([a - b for a, b in zip(loc, off)], s)]))
        return Pieces(self.shape, parts)


def layout(pmodel, name: str, shard: bool) -> Layout:
    """``name``'s layout on this rank: its plan piece, or (``shard`` and ZeRO shards it) its ZeRO shard."""
    plan = pmodel.plan
    d = plan.params[name]
    held = runs(tuple(d.shape), d.spec, pmodel._coords, plan.mesh.shape)
    zero = pmodel._zero
    if shard and zero is not None and zero.handles(name):
        _, sp = zero.sharded[name]
        return Layout(tuple(d.shape), held, (sp.lo, min(sp.hi, sp.n), tuple(sp.shape)))
    return Layout(tuple(d.shape), held)


def held_names(pmodel) -> list[str]:
    """The canonical names of the parameters and buffers this rank holds that the model's state dict has."""
    keys = set(pmodel._state_keys)
    return [name for name, d in pmodel.plan.params.items()
            if d.kind != "constant" and pmodel.program.has(name) and (not keys or keys & set(d.aliases))]


def model_tensor(pmodel, name: str) -> tuple[torch.Tensor, Layout]:
    """The tensor holding this rank's part of ``name`` (written in place on load) and its layout:
    the program's piece; under ZeRO-1/2 the working piece; under ZeRO-3 the shard."""
    zero = pmodel._zero
    if zero is not None and zero.handles(name):
        if zero.stage == 3:
            return pmodel.program.local_tensor(name), layout(pmodel, name, shard=True)
        return zero.working(name), layout(pmodel, name, shard=False)
    return pmodel.program.local_tensor(name), layout(pmodel, name, shard=False)


def model_state(pmodel) -> dict:
    out = {MODEL + name: lay.pieces(t) for name in held_names(pmodel) for t, lay in [model_tensor(pmodel, name)]}
    for key, value in pmodel._extra_state.items():
        out[MODEL + key] = value.detach()
    return out


def param_names(pmodel, optimizer) -> list[list[str]]:
    """Canonical names of the optimizer's parameters, group by group (``pmodel.named_parameters()``)."""
    names = {id(p): n for n, p in pmodel.named_parameters()}
    out = []
    for i, group in enumerate(optimizer.param_groups):
        out.append([])
        for p in group["params"]:
            if idle_rank.is_placeholder(pmodel, p):
                out[-1].append(idle_rank.NAME)
                continue
            if id(p) not in names:
                raise CheckpointError(f"param group {i} of the optimizer holds a tensor of shape {list(p.shape)} "
                                      "that is not one of this module's parameters; build the optimizer on "
                                      "pmodel.parameters() (under ZeRO they are this rank's shards)")
            out[-1].append(names[id(p)])
    return out


def optimizer_state(pmodel, optimizer) -> tuple[dict, dict]:
    """This rank's optimizer entries, and what the checkpoint's ``autopar`` entry records of the
    optimizer: class, param groups (hyperparameters, parameters by name) and each parameter's state keys."""
    entries, keys, groups = {}, {}, []
    names = param_names(pmodel, optimizer)
    for group, gnames in zip(optimizer.param_groups, names):
        for p, name in zip(group["params"], gnames):
            if name == idle_rank.NAME:      # never stepped: no state, not recorded
                continue
            state = optimizer.state.get(p, {})
            lay = layout(pmodel, name, shard=True)
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    if v.shape != p.shape:
                        raise CheckpointError(
                            f"optimizer state {k!r} of parameter {name!r} has shape {list(v.shape)}, not the "
                            f"parameter's {list(p.shape)}: autopar checkpoints reshard parameter-shaped and "
                            "scalar optimizer state only")
                    entries[f"{OPTIM}{name}.{k}"] = lay.pieces(v)
                else:
                    entries[f"{OPTIM}{name}.{k}"] = v.detach() if isinstance(v, torch.Tensor) else v
            keys[name] = list(state)
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [n for n in gnames if n != idle_rank.NAME]})
    cls = type(optimizer)
    return entries, {"class": f"{cls.__module__}.{cls.__qualname__}", "groups": groups, "state_keys": keys}


def merge_optimizer_info(infos: list[dict]) -> dict:
    """One record from every rank's: hyperparameters of rank 0, each group's names in rank order."""
    counts = sorted({len(info["groups"]) for info in infos})
    if len(counts) > 1:
        raise CheckpointError(f"the ranks' optimizers have different numbers of param groups ({counts}); build "
                              "the same param groups on every rank (a group may hold no parameters of a rank)")
    out = {"class": infos[0]["class"], "groups": [], "state_keys": {}}
    for i, g in enumerate(infos[0]["groups"]):
        seen = []
        for info in infos:
            for n in info["groups"][i]["params"]:
                if n not in seen:
                    seen.append(n)
        out["groups"].append({**g, "params": seen})
    for info in infos:
        out["state_keys"].update(info["state_keys"])
    return out


def optimizer_step(optimizer) -> int | None:
    """The optimizer's step count: the largest ``step`` in its state (None where it keeps none)."""
    steps = [float(s["step"]) for s in optimizer.state.values() if "step" in s]
    return int(max(steps)) if steps else None
