"""Export without recording each node's Python stack trace, the way ``trace`` exports.

torch.fx captures and symbolises a stack trace per node (``meta["stack_trace"]``): a quarter of a
static export's CPU on a 32-layer Llama. autopar reads it only to name the source line of a size made
from tensor values (``static_shapes.py``), so a step is exported without it and exported again with
it only where that error is raised.
"""
from __future__ import annotations

import contextlib

import torch.fx as fx


@contextlib.contextmanager
def stack_traces(record: bool):
    """Within: fx tracers record ``meta["stack_trace"]`` only where ``record``."""
    before = fx.config.do_not_emit_stack_traces
    fx.config.do_not_emit_stack_traces = not record
    try:
        yield
    finally:
        fx.config.do_not_emit_stack_traces = before
