"""A traced step whose sizes depend on tensor values is refused with the place that reads them.

Non-strict ``torch.export`` traces ``counts.tolist()`` / ``.item()`` into ``aten.item`` nodes giving
unbacked sizes (``u0``), and shapes built from them (``torch.split(rows, counts.tolist())``, as
torchtitan's for-loop experts do). autopar plans and shards fixed shapes, so such a graph is a
``TraceError`` naming the module and source line of the first value read, and what to write instead.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.core.errors import TraceError


def _symbolic(v) -> bool:
    if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
        return True
    if isinstance(v, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in v.shape)
    if isinstance(v, (list, tuple)):
        return any(_symbolic(x) for x in v)
    return False


def _where(node: fx.Node, prefix: str) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    path = next(reversed(stack.values()))[0] if stack else ""
    path = path[len(prefix):] if path.startswith(prefix) else path
    frames = [ln.strip() for ln in (node.meta.get("stack_trace") or "").strip().splitlines()]
    line = next((f for f in reversed(frames) if f.startswith("File ")), "")
    module = f"in module {path!r}" if path else "in the model"
    return f"{module}{' (' + line + ')' if line else ''}"


def first_symbolic(gm: fx.GraphModule) -> fx.Node | None:
    """The first node whose value or shape depends on tensor values (None: every size is fixed)."""
    return next((n for n in gm.graph.nodes if n.op != "placeholder" and _symbolic(n.meta.get("val"))), None)


def check_static_shapes(gm: fx.GraphModule, prefix: str = "model.") -> None:
    """Raise a TraceError at the first node whose value or shape depends on tensor values (its source
    line from ``meta["stack_trace"]`` where the export recorded one)."""
    node = first_symbolic(gm)
    if node is not None:
        raise TraceError(
            f"autopar could not trace the model {_where(node, prefix)}: {node.target} makes a size from a "
            f"tensor's values (.item()/.tolist(), or a shape that depends on data), and autopar plans fixed "
            f"shapes.\nWhat to try: keep shapes independent of values, e.g. mixture-of-experts layers run the "
            f"experts on all sorted rows at once (torch._grouped_mm with offsets, or bmm with gathered "
            f"expert weights) instead of torch.split(x, counts.tolist()).")
