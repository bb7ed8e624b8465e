"""What ``pmodel.step`` checks first and what it returns.

* A model with no trainable parameter (none at all, or every one frozen) has no gradient to take:
  ``step`` says so before running anything (``check_trainable``), rather than torch's raw "element 0
  of tensors does not require grad" from inside the program's backward.
* ``step`` runs forward *and* backward; the loss it returns is a report (the global mean loss, for
  logging), detached from any graph. Its type is ``StepLoss``, a plain tensor in every other
  respect (operations on it give ordinary tensors), whose ``backward()`` raises a clear error
  instead of torch's "does not require grad": the gradients are already in place, call the
  optimizer's ``step()`` next.
"""
from __future__ import annotations

import torch


class StepLoss(torch.Tensor):
    """The loss ``pmodel.step`` returns: its ``backward()`` explains that step already ran backward."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents=None):
        return repr(self.as_subclass(torch.Tensor))

    def backward(self, *args, **kwargs):
        if self.requires_grad:          # not ours: a value that is part of a graph
            return super().backward(*args, **kwargs)
        raise RuntimeError("the loss pmodel.step(...) returns is detached: pmodel.step already ran the backward "
                           "pass (the gradients are in place on pmodel's parameters). Do not call loss.backward(); "
                           "call opt.step() (and opt.zero_grad()) next. The returned loss is the global mean, for "
                           "logging")


def step_loss(value: torch.Tensor) -> StepLoss:
    """``value`` (the detached global loss) as a ``StepLoss``."""
    return value.detach().as_subclass(StepLoss)


def check_trainable(plan) -> None:
    """Raise a ValueError when the planned model has no parameter that takes a gradient."""
    params = [d for d in plan.params.values() if d.kind == "parameter"]
    if any(d.trainable for d in params):
        return
    what = ("has no parameters" if not params else
            f"has no trainable parameter (its {len(params)} parameter(s) are frozen, requires_grad=False)")
    raise ValueError(f"pmodel.step() trains, but the model {what}: its loss has no gradient to take. Use pmodel(x) "
                     "for a forward pass, or give the model a parameter that requires grad before parallelize()")
