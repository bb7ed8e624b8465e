"""Optimizers that cannot train on a rank's pieces, refused by name at their first ``step()``.

``pmodel.parameters()`` are this rank's pieces: tensor-parallel slices, ZeRO's flat shards, a
pipeline stage's parameters. An element-wise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad,
Adadelta, Adamax, NAdam, RAdam, ASGD, Rprop) updates each element from that element's own
gradient and state, so it steps on pieces exactly as on whole tensors. These do not:

* ``Adafactor`` factors its second moment over a matrix's rows and columns and scales its step
  by the parameter's norm, ``Muon`` orthogonalises each weight matrix: both need every parameter
  whole on the rank (no tensor split, no ZeRO);
* ``LBFGS`` takes dot products over all parameters at once: it needs every parameter whole on
  every rank (data parallelism only: no tensor split, no ZeRO, no pipeline);
* ``SparseAdam`` needs sparse gradients, which autopar's programs do not make.

A global optimizer step pre-hook (registered with the first ParallelModule) looks up the ParallelModule that owns the optimizer's
parameters (a weak set of live modules, asked only for these classes) and raises a TypeError
naming the optimizer, a parameter it would get wrong and what to use instead.
"""
from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

_WHOLE_TENSOR = {
    "Adafactor": "it factors each matrix's second moment over its rows and columns and scales the step by the "
                 "parameter's norm",
    "Muon": "it orthogonalises each whole weight matrix",
}
_WHOLE_MODEL = {"LBFGS": "its line search takes dot products over every parameter of the model at once"}
_REFUSED = {"SparseAdam": "it needs sparse gradients, and autopar's programs make dense ones"}

_MODULES: "weakref.WeakSet" = weakref.WeakSet()


_CLASSES = {n: c for n in (*_WHOLE_TENSOR, *_WHOLE_MODEL, *_REFUSED)
            if isinstance(c := getattr(torch.optim, n, None), type)}     # the ones this torch has
_CHECKED = tuple(_CLASSES.values())


_HOOK: list = []


def watch(pmodel) -> None:
    """Check optimizers over ``pmodel``'s parameters; ``pmodel.split_parameters()`` -> {name: how it is split}
    and ``pmodel.holds_every_parameter`` say what its rank holds. The global step pre-hook is
    registered with the first module watched, not when autopar is imported."""
    _MODULES.add(pmodel)
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: check_optimizer(optimizer)))


def _owner(optimizer):
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return next((m for m in list(_MODULES) if any(id(p) in ids for p in m.parameters())), None)


def check_optimizer(optimizer) -> None:
    """Raise a TypeError if ``optimizer`` cannot train the pieces of the ParallelModule it holds."""
    if not isinstance(optimizer, _CHECKED):
        return
    pmodel = _owner(optimizer)
    if pmodel is None:
        return
    name = next(n for n, c in _CLASSES.items() if isinstance(optimizer, c))
    alternatives = "use an element-wise optimizer (AdamW, Adam, SGD, RMSprop, Adagrad, ...)"
    if name in _REFUSED:
        raise TypeError(f"torch.optim.{name} cannot train an autopar module: {_REFUSED[name]}; {alternatives}")
    split = pmodel.split_parameters()
    why = {**_WHOLE_TENSOR, **_WHOLE_MODEL}[name]
    if name in _WHOLE_MODEL and not pmodel.holds_every_parameter:     # first: whole parameters would not help
        raise TypeError(f"torch.optim.{name} cannot train under this plan: {why}, but this rank holds only its "
                        f"pipeline stage's parameters. Either {alternatives}, or plan without a pipeline "
                        "(mode='data' with autopar.set_auto_parallel_context(zero=0))")
    if split:
        first, how = next(iter(split.items()))
        raise TypeError(f"torch.optim.{name} cannot train under this plan: {why}, but this rank holds only pieces "
                        f"of {len(split)} parameter(s) (e.g. {first}: {how}). Either {alternatives}, or plan so "
                        "that every parameter stays whole: mode='data' with "
                        "autopar.set_auto_parallel_context(zero=0)")
