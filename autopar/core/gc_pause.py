"""Fewer garbage collections while planning.

Tracing and solving allocate millions of short-lived objects while the traced graphs, problems and
candidates stay alive, so with Python's default thresholds (a young collection every 700 net
allocations) each young-generation pass, and every tenth older pass, walks a heap that grows with
the model, so the passes' cost grows with the model squared. Raising the young threshold for the
duration of a plan keeps cycles collected (a pass every 100k allocations) in a few passes
(bench/RESULTS.md). The previous thresholds come back on exit, errors included.
"""
from __future__ import annotations

import contextlib
import gc

PLANNING_THRESHOLD = 100_000


@contextlib.contextmanager
def fewer_collections(threshold: int = PLANNING_THRESHOLD):
    """Raise the young-generation threshold to ``threshold`` inside the block (never lower it)."""
    before = gc.get_threshold()
    if before[0] and before[0] < threshold:
        gc.set_threshold(threshold, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)
