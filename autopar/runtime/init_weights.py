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
import inspect
import re
from typing import Callable

import torch
import torch.nn as nn

from autopar.runtime.pieces import local_pieces, refresh, write_full
from autopar.runtime.replay_init import InitReplayError, Replayer, Shadow, _Tensor


def _conv1d(m: nn.Module, replay) -> None:
    nn.init.normal_(m.weight, std=0.02)      # transformers.pytorch_utils.Conv1D.__init__
    nn.init.zeros_(m.bias)


def _vit_embeddings(m: nn.Module, replay) -> None:
    nn.init.normal_(m.cls_token)             # torch.randn, in transformers' ViTEmbeddings.__init__ order
    if m.mask_token is not None:
        nn.init.zeros_(m.mask_token)
    replay(m.patch_embeddings)
    nn.init.normal_(m.position_embeddings)


# modules whose __init__ draws random numbers itself (no reset method to replay): class path ->
# f(module, replay) doing the same in the same order; replay(child) runs a child's own steps
CONSTRUCTION_INITS: dict[str, Callable] = {
    "transformers.pytorch_utils.Conv1D": _conv1d,
    "transformers.models.vit.modeling_vit.ViTEmbeddings": _vit_embeddings,
}
# what in an __init__'s source draws random numbers (such a class must be in CONSTRUCTION_INITS)
_RANDOM_IN_INIT = re.compile(r"\btorch\.(randn|rand|randint|randperm|normal|bernoulli|multinomial)\(|"
                             r"\.(normal_|uniform_|bernoulli_|random_|exponential_|cauchy_|log_normal_)\(|"
                             r"\binit\.\w+_\(|\bself\.apply\(")


def _class_path(m: nn.Module) -> str:
    return f"{type(m).__module__}.{type(m).__qualname__}"


def check_replayable(model: nn.Module) -> None:
    """Raise if a module's ``__init__`` draws random numbers outside a reset method (not replayable)."""
    seen = set()
    for name, m in model.named_modules():
        cls = type(m)
        if cls in seen or cls.__module__.startswith("torch.") or _class_path(m) in CONSTRUCTION_INITS:
            continue
        seen.add(cls)
        src = ""
        for klass in cls.__mro__:
            if klass.__module__.startswith("torch.") or klass is object:
                break
            init = klass.__dict__.get("__init__")
            try:
                src += inspect.getsource(init) if init is not None else ""
            except (OSError, TypeError):
                pass
        hit = _RANDOM_IN_INIT.search(src)
        if hit:
            raise InitReplayError(
                f"{cls.__qualname__}.__init__ (module {name or 'the model'!r}) draws random numbers itself "
                f"({hit.group(0).strip('(')!r}), which a model built on the meta device cannot replay exactly: move "
                "that initialization into the module's reset_parameters() (called at the end of __init__, as "
                "torch's layers do) or the model's init_weights(), or load the weights")


def _is_hf(m: nn.Module) -> bool:
    return any(c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel" for c in type(m).__mro__)


def _construction_init(m: nn.Module) -> Callable[[], None] | None:
    cls = type(m)
    for name in ("reset_parameters", "_reset_parameters"):
        if callable(getattr(cls, name, None)):
            return getattr(m, name)
    return None


def init_steps(model: nn.Module) -> list[tuple[str, nn.Module, Callable[[], None]]]:
    """(label, module, call) for each init step of ``model``, in the order one device runs them."""
    if not _is_hf(model) and callable(getattr(model, "init_weights", None)):
        return [(f"{type(model).__name__}.init_weights()", model, model.init_weights)]
    out, seen = [], set()

    def replay(m: nn.Module) -> None:
        for _, _, call in init_steps(m):
            call()

    def visit(m: nn.Module, path: str) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        label = path or type(m).__name__
        special = CONSTRUCTION_INITS.get(_class_path(m))
        if special is not None:
            seen.update(id(s) for s in m.modules())
            out.append((f"{label}: {type(m).__name__} init", m, lambda: special(m, replay)))
            return
        for name, child in m.named_children():
            visit(child, f"{path}.{name}" if path else name)
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
        pieces = local_pieces(pmodel, everything=True)
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
        if _is_hf(self.model) or not callable(getattr(self.model, "init_weights", None)):
            check_replayable(self.model)
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
                f"init_weights: no initialization step writes {', '.join(missing[:6])}"
                f"{', ...' if len(missing) > 6 else ''}"
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
    refresh(pmodel)


__all__ = ["CONSTRUCTION_INITS", "InitReplayError", "check_replayable", "init_steps", "init_weights"]
