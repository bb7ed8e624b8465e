"""``pmodel.init_weights(seed)``: each rank's pieces of a meta-built model, equal bit for bit to the
same pieces of the model built for real on one CPU under ``torch.manual_seed(seed)``.

The init steps that consume the random generator are replayed in construction order on the meta
model (``runtime/replay_init.py``), which keeps only this rank's pieces:

- a model with its own ``init_weights()`` (torchtitan's convention: built on meta, ``to_empty``,
  seeded, ``init_weights()``) and no Hugging Face base: that call alone;
- otherwise, modules after their children (a module's ``__init__`` builds its children, then
  resets itself): each module's ``reset_parameters()`` / ``_reset_parameters()`` (torch's layers), or
  its entry in ``CONSTRUCTION_INITS`` (layers that initialize in ``__init__`` without a reset method);
  a Hugging Face ``PreTrainedModel`` then runs its own ``initialize_weights()`` (what its
  ``post_init`` runs on a real device), nested models first, as their ``__init__`` do.

A parameter shared by several modules (tied weights) takes the values its first module (by name)
writes; another module's writes to it go to a discarded stand-in, as on one device, where that
module initialized its own tensor before the tie replaced it. A tensor no step writes (e.g.
``nn.Parameter(torch.randn(...))`` in an ``__init__``, a buffer computed there) is an error naming it."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn as nn

from autopar.runtime.materialize import finish, local_pieces, write_full
from autopar.runtime.replay_init import InitReplayError, Replayer, Shadow, _Tensor


def _conv1d(m: nn.Module) -> None:
    nn.init.normal_(m.weight, std=0.02)      # transformers.pytorch_utils.Conv1D.__init__
    nn.init.zeros_(m.bias)


# layers whose __init__ initializes them without a reset method: class path -> that init
CONSTRUCTION_INITS: dict[str, Callable[[nn.Module], None]] = {"transformers.pytorch_utils.Conv1D": _conv1d}


def _is_hf(m: nn.Module) -> bool:
    return any(c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel" for c in type(m).__mro__)


def _construction_init(m: nn.Module) -> Callable[[], None] | None:
    cls = type(m)
    special = CONSTRUCTION_INITS.get(f"{cls.__module__}.{cls.__qualname__}")
    if special is not None:
        return lambda: special(m)
    for name in ("reset_parameters", "_reset_parameters"):
        if callable(getattr(cls, name, None)):
            return getattr(m, name)
    return None


def init_steps(model: nn.Module) -> list[tuple[str, nn.Module, Callable[[], None]]]:
    """(label, module, call) for each init step of ``model``, in the order one device runs them."""
    if not _is_hf(model) and callable(getattr(model, "init_weights", None)):
        return [(f"{type(model).__name__}.init_weights()", model, model.init_weights)]
    out, seen = [], set()

    def visit(m: nn.Module, path: str) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        for name, child in m.named_children():
            visit(child, f"{path}.{name}" if path else name)
        label = path or type(m).__name__
        if _is_hf(m):
            out.append((f"{label}: {type(m).__name__}.initialize_weights()", m, m.initialize_weights))
            return
        call = _construction_init(m)
        if call is not None:
            out.append((f"{label}: {type(m).__name__} init", m, call))

    visit(model, "")
    return out


def _clear_hf_flags(model: nn.Module) -> None:
    """Forget Hugging Face's "already initialized" marks (a fresh model on one device has none)."""
    for obj in [*model.modules(), *model.parameters(), *model.buffers()]:
        obj.__dict__.pop("_is_hf_initialized", None)


class _Replay:
    def __init__(self, pmodel, model: nn.Module):
        self.model = model
        pieces = local_pieces(pmodel)
        by_alias = dict(pieces)
        for name, d in pmodel.plan.params.items():
            for alias in d.aliases:
                by_alias.setdefault(alias, pieces.get(name))
        names: dict[int, list[str]] = {}
        self.shadows: dict[int, Shadow] = {}
        for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            names.setdefault(id(t), []).append(n)
            self.shadows.setdefault(id(t), Shadow(t))
        self.tracked = {id(self.shadows[k]): _Tensor(ns, next((by_alias[n] for n in ns if by_alias.get(n) is not None),
                                                             None)) for k, ns in names.items()}
        modules = dict(model.named_modules(remove_duplicate=False))
        self.owner = {id(self.shadows[id(t)]): modules[n.rpartition(".")[0]] for n, t in
                      [*model.named_parameters(), *model.named_buffers()]}
        self.slots = [(m, kind, attr, t) for m in model.modules() for kind in ("_parameters", "_buffers")
                      for attr, t in getattr(m, kind).items() if t is not None]
        self.where: list[str] = []
        self.mode = Replayer(self.tracked, self.where)

    @contextlib.contextmanager
    def stand_ins(self, m: nn.Module):
        """``m``'s own parameters that another module owns (tied) replaced by discarded stand-ins."""
        swapped = []
        for attr, p in list(m._parameters.items()):
            if p is not None and self.owner.get(id(p)) is not m:
                s = Shadow(p)
                self.tracked[id(s)] = _Tensor([f"{attr} (tied stand-in)"], None, scratch=True)
                m._parameters[attr] = s
                swapped.append((attr, p, s))
        try:
            yield
        finally:
            for attr, p, s in swapped:
                self.mode.held.pop(id(s), None)
                self.tracked.pop(id(s), None)
                m._parameters[attr] = p

    def _hf_wrapped(self, m: nn.Module, call: Callable[[], None]) -> Callable[[], None]:
        """``call`` with every Hugging Face model's per-module init run with ``stand_ins``."""
        def run():
            subs = [s for s in m.modules() if _is_hf(s)]
            for s in subs:
                orig = s._initialize_weights

                def wrapped(module, *args, _orig=orig, **kw):
                    with self.stand_ins(module):
                        return _orig(module, *args, **kw)
                s.__dict__["_initialize_weights"] = wrapped
            try:
                call()
            finally:
                for s in subs:
                    s.__dict__.pop("_initialize_weights", None)
        return run

    def run(self, seed: int) -> None:
        _clear_hf_flags(self.model)
        for m, kind, attr, t in self.slots:
            getattr(m, kind)[attr] = self.shadows[id(t)]
        try:
            torch.manual_seed(seed)
            with torch.no_grad(), self.mode:
                for label, m, call in init_steps(self.model):
                    self.where.append(label)
                    with self.stand_ins(m):
                        (self._hf_wrapped(m, call) if _is_hf(m) else call)()
                    self.mode.flush()
                    self.where.pop()
            self._reassigned()
        finally:
            for m, kind, attr, t in self.slots:
                getattr(m, kind)[attr] = t
        _clear_hf_flags(self.model)
        missing = [i.names[0] for i in self.tracked.values() if not i.written]
        if missing:
            raise InitReplayError(
                f"init_weights: no initialization step writes {', '.join(missing[:6])}{', ...' if len(missing) > 6 else ''}"
                " (set in an __init__, e.g. nn.Parameter(torch.randn(...)) or a buffer computed there, which a meta "
                "model cannot replay): give its module a reset_parameters() (or the model an init_weights()) that "
                "writes it, or load the weights (pmodel.load_full_state_dict / load_pretrained)")

    def _reassigned(self) -> None:
        """Tensors an init step replaced by assignment (``self.freqs = compute()``): their new values."""
        for m, kind, attr, t in self.slots:
            now = getattr(m, kind).get(attr)
            shadow = self.shadows[id(t)]
            if now is not shadow and isinstance(now, torch.Tensor) and not isinstance(now, Shadow) and not now.is_meta:
                info = self.tracked[id(shadow)]
                if info.piece is not None:
                    write_full(info.piece, now.detach())
                info.written = True


def init_weights(pmodel, seed: int = 0) -> None:
    """Fill this rank's pieces of the meta model ``pmodel`` was built from (see the module doc)."""
    model = getattr(pmodel, "_meta_model", None)
    if model is None:
        raise ValueError("pmodel.init_weights() initializes a model given to parallelize() on the meta device; this "
                         "one was built from real weights, which it holds already")
    _Replay(pmodel, model).run(seed)
    finish(pmodel)


__all__ = ["CONSTRUCTION_INITS", "InitReplayError", "init_steps", "init_weights"]
