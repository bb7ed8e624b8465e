"""Cost terms of ZeRO (``plan.memory_options.zero``) for one parameter replicated over ``d`` ranks.

Memory per rank (ZeRO paper, Rajbhandari et al. 2020, section 5), for a parameter of ``n``
elements with ``w`` bytes per weight, ``g`` per gradient element and ``k`` bytes of optimizer state
per element (AdamW in fp32: two moments, ``k = 8``; with bf16 mixed precision the fp32 master copy
counts as optimizer state, ``k = 12``):

======  ===========  ===========  ===========
stage   weights      gradients    optimizer
======  ===========  ===========  ===========
0       n·w          n·g          n·k
1       n·w          n·g          n·k / d
2       n·w          n·g / d      n·k / d
3       n·w / d      n·g / d      n·k / d
======  ===========  ===========  ===========

(``/d`` is ``ceil(n / d)`` elements: chunks are padded to equal size.) Stage 3 also holds, while a
layer runs, that layer's gathered weights: ``zero3_gathered_bytes``.

Communication per step, ``B = n·g`` the gradient bytes (the ring formulas of ``comm.py``):

======  =====================================================  ==================
stage   collectives                                            volume per rank
======  =====================================================  ==================
0       all_reduce(B)                     (DDP)                2(d-1)/d · B
1, 2    reduce_scatter(B) + all_gather(n·w)                    2(d-1)/d · B
3       reduce_scatter(B) + 2 × all_gather(n·w) (fwd + bwd)    3(d-1)/d · B  (1.5x)
======  =====================================================  ==================

(The all-gather moves weights, ``n·w`` bytes; with ``w == g`` the volumes are as listed.) With k
accumulated microbatches, stages 0 and 1 sum gradients once, after the last; stages 2 and 3
reduce-scatter in every microbatch (the gradients never exist whole beyond one layer's bucket),
so their reduce-scatter runs k times.

Optimizer step: each rank updates ``ceil(n / d)`` elements, so the step time divides by ``d``
(stage ≥ 1): ``optimizer_step_time(t, d, stage) = t / d``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.sharding.placements import Replicate

from .comm import axis_collective_time
from .devices import DeviceSpec


PIPELINE_ZERO = (0, 1)      # the stages that run with a pipeline (``runtime/pipeline_zero.py``; DeepSpeed's rule)
ZERO_BUCKET_MB = 25.0      # the runtime's bucket cap (``runtime/zero.py``), MiB of padded gradients


def zero1_bucket_bytes(buckets: list[tuple[int, int]], d: int, input_copied: bool) -> float:
    """Bytes ZeRO-1's reduce-scatter of its largest bucket holds beside the training state, after
    backward: the ``(d, C)`` input the working gradients are copied into, a second copy where the
    collective copies its input (gloo's ``reduce_scatter_single`` does), and this rank's ``C``
    output. ``buckets``: (``C``, bytes per element) of each bucket (``zero_buckets``)."""
    return max((width * e * (d * (2 if input_copied else 1) + 1) for width, e in buckets), default=0.0)


def zero_buckets(params: list[tuple[str, int, int]], d: int, bucket_mb: float = ZERO_BUCKET_MB) -> list[tuple[int, int]]:
    """The runtime's buckets of one axis set (``runtime/zero.py``): ``params`` as (name, elements,
    bytes per element), cut in name order where the padded bytes would pass ``bucket_mb`` or the
    element size changes; (width ``C``: the sum of the chunks ``ceil(n / d)``, bytes per element)
    of each bucket."""
    out: list[list[int]] = []
    size = 0.0
    for _, numel, e in sorted(params):
        c = shard_elements(numel, d)
        if not out or size + c * d * e > bucket_mb * 2 ** 20 or e != out[-1][1]:
            out.append([0, e])
            size = 0.0
        out[-1][0] += c
        size += c * d * e
    return [(w, e) for w, e in out]


def gather_unit(name: str) -> str:
    """The unit ZeRO-3 gathers at once for parameter ``name``: its name up to the first numeric
    part ("blocks.0"), else its owner module ("ln_f")."""
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1]) or name


def zero_axes(spec, mesh_shape) -> tuple[list[int], int]:
    """(the mesh axes ZeRO shards a parameter stored as ``spec`` over, their rank count d): the
    axes of size > 1 on which it is replicated."""
    axes = [a for a, p in enumerate(spec) if isinstance(p, Replicate) and mesh_shape[a] > 1]
    return axes, math.prod(mesh_shape[a] for a in axes)


def sharded_state(weights: float, grads: float, optimizer: float, d: int, stage: int) -> float:
    """Per-rank bytes of a parameter's training state split into its parts (table above; the
    padding of ``ceil`` is ignored)."""
    _check(stage, d)
    return (weights / (d if stage >= 3 else 1) + grads / (d if stage >= 2 else 1)
            + optimizer / (d if stage >= 1 else 1))


def _check(stage: int, d: int) -> None:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if d < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {d}")


@dataclass(frozen=True)
class ZeroMemory:
    """Bytes one rank holds for a parameter: weights, gradients, optimizer state."""

    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


def shard_elements(numel: int, d: int) -> int:
    """Elements one rank's chunk holds (padded to equal chunks)."""
    return math.ceil(numel / d) if numel else 0


def zero_memory(numel: int, d: int, stage: int, weight_bytes: int = 4, grad_bytes: int = 4,
                optimizer_bytes: int = 8) -> ZeroMemory:
    """Per-rank bytes of one parameter of ``numel`` elements replicated over ``d`` ranks (table in module doc)."""
    _check(stage, d)
    part = shard_elements(numel, d)
    return ZeroMemory(weights=(part if stage >= 3 else numel) * weight_bytes,
                      grads=(part if stage >= 2 else numel) * grad_bytes,
                      optimizer=(part if stage >= 1 else numel) * optimizer_bytes)


def zero3_gathered_bytes(layer_numel: int, weight_bytes: int = 4, prefetch: bool = True) -> float:
    """ZeRO-3's transient weights: the running layer gathered in full, plus the next one when prefetched."""
    return layer_numel * weight_bytes * (2 if prefetch else 1)


def zero_collectives(numel: int, d: int, stage: int, weight_bytes: int = 4,
                     grad_bytes: int = 4) -> list[tuple[str, float, str]]:
    """The collectives one step runs for the parameter: (kind, full bytes, phase)."""
    _check(stage, d)
    if d == 1:
        return []
    grads, weights = numel * grad_bytes, numel * weight_bytes
    if stage == 0:
        return [("all_reduce", grads, "bwd")]
    out = [("reduce_scatter", grads, "bwd"), ("all_gather", weights, "step")]
    if stage == 3:
        out = [("all_gather", weights, "fwd"), ("all_gather", weights, "bwd"), ("reduce_scatter", grads, "bwd")]
    return out


def zero_comm_volume(numel: int, d: int, stage: int, weight_bytes: int = 4, grad_bytes: int = 4) -> float:
    """Bytes one rank sends per step (ring): (d-1)/d of every collective's full size, twice for an all-reduce."""
    total = 0.0
    for kind, nbytes, _ in zero_collectives(numel, d, stage, weight_bytes, grad_bytes):
        total += (2 if kind == "all_reduce" else 1) * (d - 1) / d * nbytes
    return total


def zero_comm_time(numel: int, d: int, stage: int, device: DeviceSpec, inner_size: int = 1,
                   weight_bytes: int = 4, grad_bytes: int = 4) -> float:
    """Seconds of the step's collectives for the parameter over a data-parallel axis of size ``d``
    (stride ``inner_size``), by ``comm.axis_collective_time`` (no overlap assumed)."""
    return sum(axis_collective_time(kind, nbytes, device, d, inner_size)
               for kind, nbytes, _ in zero_collectives(numel, d, stage, weight_bytes, grad_bytes))


def optimizer_step_time(unsharded_time: float, d: int, stage: int) -> float:
    """The optimizer step's seconds: each rank updates 1/d of the elements from stage 1 on."""
    _check(stage, d)
    return unsharded_time / d if stage >= 1 else unsharded_time
