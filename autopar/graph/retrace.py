"""Traces at another batch size (pipeline microbatches), and the graph fingerprint that
tells whether a plan was made for a traced graph."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.frontend.call_inputs import map_tensors
from autopar.graph.chunk_hints import mark_chunk_hints
from autopar.graph.rescale import reference_batches, rescaled
from autopar.frontend.trace import trace


def graph_fingerprint(gm: fx.GraphModule) -> str:
    """Hash of every node's op, name, target and shape: a plan is refused on a graph it was not made for."""
    h = hashlib.sha1()
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        shape = tuple(v.shape) if isinstance(v, torch.Tensor) else None
        h.update(f"{n.op}|{n.name}|{n.target}|{shape}".encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Retracer:
    """What re-tracing the training step at another batch size needs; ``retracer(batch)`` -> Traced."""

    model: object
    example_inputs: object
    loss_fn: object = None
    example_target: object = None
    mixed_precision: str | None = None
    example_kwargs: dict | None = None

    def __call__(self, batch: int):
        return retrace_batch(self.model, self.example_inputs, self.loss_fn, self.example_target, batch,
                             self.mixed_precision, self.example_kwargs)


def microbatch_trace(traced, batch: int, retracer: Retracer | None, rescale: bool = True):
    """The training step with every input and the target cut to ``batch`` rows (cached). With
    ``rescale`` (planning), derived from two traces that differ only in batch-affine sizes
    (``graph/rescale.py``): the first of the ``reference_batches`` and the global step itself
    (not the second reference, which would be an export for nothing), or, where
    the global graph differs otherwise, the second reference (one export more); else traced
    again; the runtime traces (``rescale=False``) and checks the plan's fingerprint."""
    cache = traced.meta.setdefault("microbatch_traces", {})
    if batch == traced.batch_size:
        return traced
    if batch not in cache or (not rescale and cache[batch].meta.get("rescaled")):
        if retracer is None:
            raise ValueError("pipeline planning needs to re-trace the model at the microbatch shape; "
                             "pass a Retracer (autopar.plan()/parallelize() make one)")
        refs = reference_batches(traced.batch_size) if rescale else None
        mb = None
        if refs is not None and batch != refs[0]:
            first = microbatch_trace(traced, refs[0], retracer)
            mb = rescaled(first, traced, batch)     # the global step as the second point, where it matches
            if mb is None and batch != refs[1]:    # (refs[1] itself is then traced below)
                mb = rescaled(first, microbatch_trace(traced, refs[1], retracer), batch)
            if mb is not None:
                mb.meta["rescaled"] = True
        if mb is None:
            mb = retracer(batch)
        mark_chunk_hints(mb.gm)
        cache[batch] = mb
        _evict(cache, set(reference_batches(traced.batch_size) or ()) | {batch})
    cache[batch] = cache.pop(batch)      # most recently used last
    return cache[batch]


KEPT_TRACES = 6     # microbatch traces kept besides the rescaling references, the newest included


def _evict(cache: dict, keep: set) -> None:
    """Drop the least recently used microbatch traces beyond ``KEPT_TRACES`` (``keep``: the references
    and the size just derived, which counts among them):
    each holds a copy of the graph and the problems solved on it, so a pipeline search over many
    microbatch sizes would otherwise grow without bound. A dropped size is derived again if asked for."""
    others = [b for b in cache if b not in keep]          # least recently used first
    for b in others[:max(0, len(others) + 1 - KEPT_TRACES)]:
        del cache[b]


def retrace_batch(model, example_inputs, loss_fn, example_target, batch: int, mixed_precision: str | None = None,
                  example_kwargs: dict | None = None):
    """Trace ``model`` (+ loss) on the first ``batch`` rows of the example inputs (tensors, positional
    and keyword; constants kept) and target."""
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs or ())
    args, kwargs = map_tensors(lambda x: x[:batch], inputs, dict(example_kwargs or {}))
    target = example_target[:batch] if example_target is not None else None
    return trace(model, args, loss_fn, target, mixed_precision, kwargs)
