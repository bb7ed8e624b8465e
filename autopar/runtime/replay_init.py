"""Replay a model's initialization on its meta tensors, keeping only this rank's pieces.

While it replays, each meta parameter and buffer of the model is replaced by a ``Shadow`` (a tensor
subclass that looks like a CPU tensor) and the model's init code (``reset_parameters``, Hugging
Face's ``_init_weights``, a model's own ``init_weights``) runs on them as if they were real: the
first op that writes a tensor whole (a random fill, ``fill_``, ``zero_``, ``copy_``) runs on a
full-size CPU temporary, so the global generator advances exactly as on one device; the ops that follow on that tensor run on the temporary too. When the
code moves on to another tensor, the temporary is cut into this rank's pieces (``materialize.
write_full``) and freed, so at most the tensors of one init step are whole at a time. After that, an
elementwise in-place op (``mul_``, ``clamp_``, ...) on the tensor runs on its pieces (it commutes with
slicing); an op that would read the whole tensor again is an error naming it. (A view of a tensor that is not
whole keeps no link to it: writes through such a view are not seen.)"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from autopar.runtime.pieces import LocalPiece, write_full

aten = torch.ops.aten

# in-place ops that set every element without reading the old values
OVERWRITE = {"normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_", "cauchy_", "log_normal_",
             "fill_", "zero_", "copy_"}
# in-place elementwise ops: each element's new value depends only on its old value (and scalars)
ELEMENTWISE = {"mul_", "div_", "add_", "sub_", "clamp_", "clamp_min_", "clamp_max_", "erfinv_", "sqrt_", "neg_",
               "abs_", "exp_", "log_", "tanh_", "sigmoid_", "pow_", "fmod_", "remainder_", "round_", "floor_",
               "ceil_", "trunc_", "sign_", "reciprocal_", "rsqrt_", "addcmul_", "addcdiv_", "lerp_", "masked_fill_"}


class InitReplayError(RuntimeError):
    """A model's initialization cannot be replayed exactly on this rank's pieces."""


class _Tensor:
    """What the replay knows of one meta tensor: its names, its full value while held, whether written."""

    def __init__(self, names: list[str], piece: LocalPiece | None, scratch: bool = False):
        self.names = names
        self.piece = piece            # None: this rank holds none of it (another pipeline stage's)
        self.scratch = scratch        # a stand-in written by a module that does not own the tensor: discarded
        self.full: torch.Tensor | None = None
        self.written = False
        self.flushed = False


class Shadow(torch.Tensor):
    """Stands for one meta tensor of the model while its init replays: it looks like a CPU tensor (init
    code that skips meta tensors runs), and every op on it goes to the active ``Replayer``."""

    @staticmethod
    def __new__(cls, like: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device="cpu",
                                                   requires_grad=False)

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self):
        return f"Shadow(shape={list(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if _ACTIVE is None:
            raise InitReplayError(f"{func} ran on a replay stand-in outside init_weights()")
        return _ACTIVE[-1].dispatch(func, args, kwargs or {})


_ACTIVE: list | None = None


class Replayer:
    """Runs init ops on the ``Shadow`` tensors in ``tracked`` (id -> _Tensor) as the module doc says."""

    def __init__(self, tracked: dict[int, _Tensor], where: list[str]):
        self.tracked = tracked
        self.where = where            # the init step running now, for messages
        self.held: dict[int, _Tensor] = {}

    def __enter__(self):
        global _ACTIVE
        _ACTIVE = (_ACTIVE or []) + [self]
        return self

    def __exit__(self, *exc):
        global _ACTIVE
        _ACTIVE = _ACTIVE[:-1] or None

    # ---- the full temporaries --------------------------------------------------------------
    def flush(self, keep: set[int] = frozenset()) -> None:
        """Cut every held full tensor but those in ``keep`` into this rank's pieces and free it."""
        for key in [k for k in self.held if k not in keep]:
            info = self.held.pop(key)
            if info.piece is not None and not info.scratch:
                write_full(info.piece, info.full)
            info.full, info.flushed = None, True

    def _name(self, info: _Tensor) -> str:
        what = f" (while running {self.where[-1]})" if self.where else ""
        return f"{info.names[0]!r}{what}"

    def _full(self, t: torch.Tensor, op: str) -> torch.Tensor:
        info = self.tracked[id(t)]
        if info.full is not None:
            return info.full
        if not info.written:
            raise InitReplayError(f"{op} reads {self._name(info)} before any initialization wrote it: it cannot be "
                                  "replayed from a meta model; initialize it in the module's reset_parameters() or "
                                  "init_weights(), or load the weights")
        raise InitReplayError(f"{op} reads the whole of {self._name(info)} after initialization moved on to other "
                              "tensors: this rank keeps only its pieces, so it cannot be replayed exactly; write "
                              "that tensor in one init step, or load the weights")

    def dispatch(self, func, args, kwargs):
        flat = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        mine = [a for a in flat if isinstance(a, Shadow)]
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        op = func.overloadpacket.__name__
        self.flush(keep={id(a) for a in mine})
        if not (op.endswith("_") and isinstance(target, Shadow)):
            if all(self.tracked[id(a)].full is not None for a in mine):
                return func(*self._real(args, op), **self._real(kwargs, op))
            return func(*self._meta(args), **self._meta(kwargs))    # shapes only (e.g. fan-in): on meta
        info = self.tracked[id(target)]
        others = [a for a in flat if a is not target]
        if info.full is None:
            if op in OVERWRITE:
                info.full = torch.empty(target.shape, dtype=target.dtype)
            elif info.flushed and op in ELEMENTWISE and not any(isinstance(a, Shadow) or a.is_meta or a.dim() > 0
                                                               for a in others):
                for view in self._views(info):
                    func(view, *args[1:], **kwargs)
                return target
            else:
                self._full(target, op)       # raises: what it reads is gone or was never there
            self.held[id(target)] = info
            info.written, info.flushed = True, False
        for a in others:
            if a.is_meta:
                raise InitReplayError(f"{op} writes {self._name(info)} from a tensor on the meta device (a value the "
                                      "meta model never had): initialize it from real values, or load the weights")
        func(*self._real(args, op), **self._real(kwargs, op))
        return target

    def _real(self, tree, op: str):
        return tree_map(lambda a: self._full(a, op) if isinstance(a, Shadow) else a, tree)

    def _meta(self, tree):
        return tree_map(lambda a: torch.empty(a.shape, dtype=a.dtype, device="meta") if isinstance(a, Shadow) else a,
                        tree)

    def _views(self, info: _Tensor) -> list[torch.Tensor]:
        return [] if info.piece is None or info.scratch else [v for *_, v in info.piece.boxes]


__all__ = ["ELEMENTWISE", "OVERWRITE", "InitReplayError", "Replayer", "Shadow"]
