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

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex

from autopar.core.errors import CheckpointError
from autopar.runtime import idle_rank
from autopar.runtime.held_state import Pieces, held_names, layout, model_tensor

MODEL, OPTIM, META = "model.", "optim.state.", "autopar"


def rng_key(rank: int) -> str:
    return f"rng.rank{rank}"


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
