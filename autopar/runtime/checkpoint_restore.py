"""What one rank reads from a checkpoint (``Restore``): built from the checkpoint's metadata before
anything is read, it checks that the checkpoint fits this model and optimizer (each mismatch a
full message: what, where, what to do) and makes DCP's load template: views of the rank's own
tensors where the data lands in place (parameters, ZeRO shards), fresh buffers for optimizer
state, placeholders for pickled values. ``finish`` then hands the optimizer its state (by
position, as ``optimizer.load_state_dict`` expects), re-cuts ZeRO shards and restores the RNG."""
from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from autopar.runtime import idle_rank
from autopar.runtime.checkpoint_state import MODEL, OPTIM, param_names, rng_key
from autopar.runtime.held_state import held_names, layout, model_tensor

_LIST = 3       # names listed in one message at most


def _some(names: list[str]) -> str:
    more = f" and {len(names) - _LIST} more" if len(names) > _LIST else ""
    return ", ".join(repr(n) for n in names[:_LIST]) + more


class Restore:
    """One rank's load: ``template`` (for ``dcp.load``), ``problems`` (messages), ``finish()``."""

    def __init__(self, pmodel, where: str, metadata, meta: dict, rank: int):
        self.pmodel, self.where, self.md, self.meta, self.rank = pmodel, where, metadata, meta, rank
        self.template: dict = {}
        self.problems: list[str] = []
        self._after: list = []

    # ---- model -----------------------------------------------------------------------------------
    def model(self) -> None:
        pm, md = self.pmodel, self.md
        known = {MODEL + a for name, d in pm.plan.params.items() for a in (name, *d.aliases)}
        known |= {MODEL + k for k in pm._extra_state}
        unknown = sorted(k[len(MODEL):] for k in md if k.startswith(MODEL) and k not in known)
        if unknown:
            self.problems.append(f"the checkpoint at {self.where} holds {len(unknown)} model tensor(s) this model "
                                 f"does not have ({_some(unknown)}): it was saved from another model; load it into "
                                 "a model built like the one that saved it")
        for name in held_names(pm):
            d = pm.plan.params[name]
            key = next((MODEL + a for a in (name, *d.aliases) if MODEL + a in md), None)
            if key is None:
                self.problems.append(f"the checkpoint at {self.where} has no tensor {name!r} (nor its aliases "
                                     f"{d.aliases}): it was saved from another model; load it into a model built "
                                     "like the one that saved it")
                continue
            if self._shape_ok(key, name, tuple(d.shape)):
                t, lay = model_tensor(pm, name)
                self.template[key] = lay.pieces(t)
        zero = pm._zero
        if zero is not None:
            self._after.append(zero.refresh_shards)
        for k, value in pm._extra_state.items():
            key = MODEL + k
            if key not in md:
                self.problems.append(f"the checkpoint at {self.where} has no tensor {k!r}: it was saved from "
                                     "another model; load it into a model built like the one that saved it")
            elif self._shape_ok(key, k, tuple(value.shape)):
                buf = self.template[key] = torch.empty(value.shape, dtype=value.dtype)
                self._after.append(lambda k=k, buf=buf: pm._extra_state.__setitem__(k, buf))

    def _shape_ok(self, key: str, name: str, shape: tuple) -> bool:
        m = self.md[key]
        if not isinstance(m, TensorStorageMetadata):
            self.problems.append(f"the checkpoint at {self.where} holds {name!r} as a Python object, not a "
                                 "tensor; it was not written by pmodel.save")
            return False
        if tuple(m.size) != shape:
            self.problems.append(
                f"tensor {name!r} has shape {list(m.size)} in the checkpoint at {self.where} but {list(shape)} in "
                "this model: the checkpoint was saved from a model of another configuration (vocabulary, hidden "
                "size, ...); build the model with the checkpoint's configuration")
            return False
        return True

    # ---- optimizer -------------------------------------------------------------------------------
    def optimizer(self, optimizer) -> None:
        info = self.meta.get("optimizer")
        if info is None:
            self.problems.append(f"the checkpoint at {self.where} holds no optimizer state (it was saved without "
                                 "optimizer=); load it without optimizer=, or save one with it")
            return
        cls = type(optimizer)
        kind = f"{cls.__module__}.{cls.__qualname__}"
        if kind != info["class"]:
            self.problems.append(f"the checkpoint at {self.where} holds optimizer state of {info['class']} but the "
                                 f"optimizer given is {kind}; build the optimizer as {info['class']} with the same param "
                                 "groups to resume, or load without optimizer= to keep only the model")
            return
        names = param_names(self.pmodel, optimizer)
        saved = info["groups"]
        if len(saved) != len(names):
            self.problems.append(f"the checkpoint at {self.where} holds an optimizer with {len(saved)} param "
                                 f"group(s) but the optimizer given has {len(names)}; build the optimizer with the "
                                 "checkpoint's param groups (the same parameters in each)")
            return
        group_of = {n: i for i, g in enumerate(saved) for n in g["params"]}
        for i, gnames in enumerate(names):
            gnames = [n for n in gnames if n != idle_rank.NAME]     # the placeholder holds no state
            absent = [n for n in gnames if n not in group_of]
            moved = [f"{n!r} (group {group_of[n]} there)" for n in gnames if group_of.get(n, i) != i]
            if absent:
                self.problems.append(f"param group {i} of the optimizer holds {_some(absent)}, which no param group "
                                     f"of the checkpoint at {self.where} holds; build the optimizer with the "
                                     "checkpoint's param groups")
            if moved:
                self.problems.append(f"param group {i} of the optimizer holds {', '.join(moved[:_LIST])} of the "
                                     f"checkpoint at {self.where}; build the optimizer with the checkpoint's param "
                                     "groups (the same parameters in each)")
        if not self.problems:
            self._optimizer_template(optimizer, names, info)

    def _optimizer_template(self, optimizer, names, info) -> None:
        values: list[list[dict]] = []
        for group, gnames in zip(optimizer.param_groups, names):
            values.append([])
            for p, name in zip(group["params"], gnames):
                entry = {}
                if name == idle_rank.NAME:
                    values[-1].append(entry)
                    continue
                lay = layout(self.pmodel, name, shard=True)
                for k in info["state_keys"].get(name, []):
                    key = f"{OPTIM}{name}.{k}"
                    m = self.md.get(key)
                    if isinstance(m, BytesStorageMetadata):
                        self.template[key] = None
                        entry[k] = (key, None)
                    elif isinstance(m, TensorStorageMetadata) and len(m.size):
                        if not self._shape_ok(key, f"{name} ({k})", tuple(self.pmodel.plan.params[name].shape)):
                            continue
                        buf = torch.zeros(p.shape, dtype=m.properties.dtype)
                        self.template[key] = lay.pieces(buf)
                        entry[k] = (key, buf)
                    elif isinstance(m, TensorStorageMetadata):
                        entry[k] = (key, torch.empty((), dtype=m.properties.dtype))
                        self.template[key] = entry[k][1]
                    else:
                        self.problems.append(f"the checkpoint at {self.where} lacks {key!r}, which its optimizer "
                                             "record lists: the checkpoint is damaged; load an earlier one")
                values[-1].append(entry)
        self._after.append(lambda: self._load_optimizer(optimizer, values, info["groups"]))

    def _load_optimizer(self, optimizer, values, saved_groups) -> None:
        state, groups, at = {}, [], 0
        for entries, saved in zip(values, saved_groups):
            ids = []
            for entry in entries:
                got = {k: (self.template[key] if buf is None else buf) for k, (key, buf) in entry.items()}
                if got:
                    state[at] = got
                ids.append(at)
                at += 1
            groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
        optimizer.load_state_dict({"state": state, "param_groups": groups})

    # ---- RNG -------------------------------------------------------------------------------------
    def rng(self) -> None:
        """This rank's RNG state: saved rank ``r``'s (rank ``r`` modulo the saved world size)."""
        key = rng_key(self.rank)
        if key not in self.md:
            key = rng_key(self.rank % self.meta["world_size"])
        if key in self.md:
            self.template[key] = None
            self._after.append(lambda: _set_rng(self.template[key]))

    def finish(self) -> None:
        for fn in self._after:
            fn()


def rng_state() -> dict:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {"torch": torch.get_rng_state(), "cuda": cuda}


def _set_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

