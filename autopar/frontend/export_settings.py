"""How ``trace`` runs torch.export: without per-node stack traces, intermediate graph modules lazy.

- torch.fx captures and symbolises a stack trace per node (``meta["stack_trace"]``): a quarter of a
  static export's CPU on a 32-layer Llama. autopar reads it only to name the source line of a size
  made from tensor values (``static_shapes.py``), so a step is exported without it and exported again
  with it only where that error is raised.
- Export's passes rebuild and recompile the graph module several times; lazy graph modules
  (``torch.fx._lazy_graph_module``, what torch.compile uses) generate the Python code once, when it is
  first needed. The graph and its code are the same.
"""
from __future__ import annotations

import contextlib

import torch.fx as fx
from torch.fx._lazy_graph_module import _use_lazy_graph_module


@contextlib.contextmanager
def export_settings(record_stack: bool):
    """Within: fx tracers record ``meta["stack_trace"]`` only where ``record_stack``; graph modules
    recompile lazily."""
    switch = hasattr(fx.config, "do_not_emit_stack_traces")     # torch >= 2.13; older ones record them always
    before = fx.config.do_not_emit_stack_traces if switch else None
    if switch:
        fx.config.do_not_emit_stack_traces = not record_stack
    try:
        with _use_lazy_graph_module(True):
            yield
    finally:
        if switch:
            fx.config.do_not_emit_stack_traces = before
