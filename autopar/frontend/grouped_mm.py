"""``torch._grouped_mm`` in fp32 traced as a gather and a batched matmul.

torchtitan-style mixture-of-experts layers run their experts as ``torch._grouped_mm(tokens, weights,
offs=offsets)``: rows ``offs[g-1]:offs[g]`` of ``tokens`` (2-D, sorted by expert) times ``weights[g]``
(3-D, one matrix per expert). Eager CPU runs it in fp32, but torch's meta kernel (what a trace on fake
tensors calls) accepts bf16 only, so ``torch.export`` fails with ``Expected inputs of BF16 type``.
While ``traceable_grouped_mm()`` is active (during autopar's trace), such a call with non-bf16 operands
records the same product from ops that trace: each row's expert ``searchsorted(offs, row, right=True)``,
that expert's matrix gathered, ``bmm`` of the row with it (rows past ``offs[-1]`` are 0). The values are
grouped_mm's up to float rounding; the gathered weights cost ``rows x in x out`` elements of memory
(the plan counts them). Other forms (2-D x 2-D, 3-D x 3-D, bias or scales) are left to torch.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_TARGETS = {torch._grouped_mm} | ({torch.nn.functional.grouped_mm}
                                  if hasattr(torch.nn.functional, "grouped_mm") else set())


def _rewritable(args, kwargs) -> bool:
    a, b = (list(args) + [None, None])[:2]
    offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
    extra = {k: v for k, v in kwargs.items() if k not in ("offs", "out_dtype") and v is not None}
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and isinstance(offs, torch.Tensor)
            and a.dim() == 2 and b.dim() == 3 and len(args) <= 3 and not extra
            and torch.bfloat16 not in (a.dtype, b.dtype) and kwargs.get("out_dtype") in (None, a.dtype))


def gathered_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)`` for 2-D ``a`` and 3-D ``b``, from searchsorted, index and bmm."""
    groups = b.shape[0]
    rows = torch.arange(a.shape[0], device=a.device, dtype=offs.dtype)
    expert = torch.searchsorted(offs, rows, right=True)
    inside = expert < groups
    out = torch.bmm(a.unsqueeze(1), b[expert.clamp(max=groups - 1)]).squeeze(1)
    return torch.where(inside.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype, device=out.device))


class _Mode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _TARGETS and _rewritable(args, kwargs):
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            return gathered_grouped_mm(args[0], args[1], offs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def traceable_grouped_mm():
    """While active, non-bf16 2-D x 3-D ``grouped_mm`` calls record gather + bmm (see the module)."""
    with _Mode():
        yield
