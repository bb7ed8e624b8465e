"""How a call's positional and keyword arguments map to the traced graph's inputs (torch.export's
``args``/``kwargs``): tensors are graph inputs, in order (positional first, then keyword, in the
example's order); ``None`` and plain constants (bool, int, float, str) are baked into the trace,
so every later call must repeat them (or leave them out)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

CONSTANT_TYPES = (type(None), bool, int, float, str)
RESERVED_KEYWORDS = ("target", "local_batch")     # pmodel.step / pmodel(...) take these themselves


class _Tensor:
    """Marks an argument that is a graph input."""

    def __repr__(self) -> str:
        return "<tensor>"

    def __reduce__(self) -> str:
        return "TENSOR"      # unpickled as the one marker (compared with ``is``)


TENSOR = _Tensor()


def _kind(value, what: str):
    if isinstance(value, torch.Tensor):
        return TENSOR
    if isinstance(value, CONSTANT_TYPES):
        return value
    raise TypeError(f"{what} is a {type(value).__name__}; every example input must be a tensor, None or a plain "
                    "constant (bool, int, float, str): pass a nested structure's tensors as separate arguments")


@dataclass(frozen=True)
class CallSignature:
    """Per positional argument and per keyword (in the example's order): ``TENSOR`` or the constant traced."""

    args: tuple = ()
    kwargs: tuple[tuple[str, object], ...] = ()

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> "CallSignature":
        for name in kwargs:
            if name in RESERVED_KEYWORDS:
                raise ValueError(f"example_kwargs has the keyword {name!r}, which pmodel.step(...) and pmodel(...) "
                                 f"take themselves ({', '.join(RESERVED_KEYWORDS)}); wrap the model so that its "
                                 "forward names it otherwise")
        return cls(tuple(_kind(a, f"example_inputs[{i}]") for i, a in enumerate(args)),
                   tuple((k, _kind(v, f"example_kwargs[{k!r}]")) for k, v in kwargs.items()))

    @property
    def labels(self) -> list[str]:
        """What each graph input is called in messages: ``input 0`` (its position), ``keyword 'mask'``."""
        return ([f"input {i}" for i, a in enumerate(self.args) if a is TENSOR]
                + [f"keyword {k!r}" for k, v in self.kwargs if v is TENSOR])

    @property
    def num_positional_tensors(self) -> int:
        return sum(a is TENSOR for a in self.args)

    def flatten(self, args: tuple, kwargs: dict) -> list:
        """The call's graph inputs in order; a ValueError where the call does not match the plan's."""
        if len(args) > len(self.args):
            raise ValueError(f"the model was planned with {len(self.args)} input(s) but got {len(args)}")
        out = []
        for i, planned in enumerate(self.args):
            if i >= len(args) and planned is not TENSOR:
                continue            # a trailing constant left out: the traced one holds
            if i >= len(args):
                raise ValueError(f"the model was planned with {len(self.args)} input(s) but got {len(args)}")
            out += self._match(planned, args[i], f"input {i}", f"example_inputs[{i}]")
        names = dict(self.kwargs)
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            raise ValueError(f"got keyword(s) {', '.join(map(repr, unknown))} that the model was not planned with "
                             f"(planned: {', '.join(map(repr, names)) or 'none'}); re-plan with example_kwargs "
                             "naming them")
        for k, planned in self.kwargs:
            if k not in kwargs and planned is not TENSOR:
                continue
            if k not in kwargs:
                raise ValueError(f"keyword {k!r} was planned as a tensor but was not given; pass {k}=<tensor>")
            out += self._match(planned, kwargs[k], f"keyword {k!r}", f"example_kwargs[{k!r}]")
        return out

    @staticmethod
    def _match(planned, value, what: str, where: str) -> list:
        if planned is TENSOR:
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{what} must be a tensor (it was planned as one), got {type(value).__name__}")
            return [value]
        same = value is planned or (type(value) is type(planned) and not isinstance(value, torch.Tensor)
                                    and value == planned)
        if not same:
            got = f"a {type(value).__name__}" if isinstance(value, torch.Tensor) else repr(value)
            raise ValueError(f"{what} was planned as the constant {planned!r} (traced into the program) but got "
                             f"{got}; pass {planned!r} (or leave it out), or re-plan with {where} set to what "
                             "you pass")
        return []


def split_example(example_inputs, example_kwargs) -> tuple[tuple, dict]:
    """The examples as (args, kwargs), checked: at least one tensor among them, kwargs a dict of names."""
    if example_inputs is None and not example_kwargs:
        raise ValueError("example_inputs is required: pass a tuple of tensors with the GLOBAL batch shape, "
                         "e.g. example_inputs=(x,)")
    if example_inputs is None:
        example_inputs = ()
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise ValueError(f"example_inputs must be a non-empty tuple of tensors, got {type(example_inputs).__name__}")
    kwargs = {} if example_kwargs is None else example_kwargs
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise TypeError(f"example_kwargs must be a dict of keyword name -> tensor (or None / a constant), got "
                        f"{type(kwargs).__name__}")
    if not any(isinstance(v, torch.Tensor) for v in (*example_inputs, *kwargs.values())):
        if not example_inputs and not kwargs:
            raise ValueError(f"example_inputs must be a non-empty tuple of tensors, got "
                             f"{type(example_inputs).__name__}")
        CallSignature.of(tuple(example_inputs), kwargs)       # a non-constant says what it is first
        raise ValueError("the example inputs hold no tensor: pass at least one tensor with the GLOBAL batch shape "
                         "(in example_inputs or example_kwargs)")
    return tuple(example_inputs), dict(kwargs)


def map_tensors(fn, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``fn`` applied to every tensor of (args, kwargs); constants kept."""
    return (tuple(fn(a) if isinstance(a, torch.Tensor) else a for a in args),
            {k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
