"""Shrink a failing fuzz ``Case`` to a small one that fails the same way (bench/fuzz.py).

Greedy: try the one-step simplifications of ``simpler`` in order (fewer parts first: annotations,
options, ranks, layers, batch; then smaller values), keep the first that still fails the same way
(``signature``), and start again from it, until none does or the budget of case runs is spent.
Hypothesis shrinks the failures of tests/ranks/test_fuzz.py itself; a benchmark of hundreds of cases
shrinks each distinct failure here, with a bounded number of runs.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator

from fuzz_cases import Case
from fuzz_check import Outcome
from fuzz_models import MLPSpec, TransformerSpec


def signature(outcome: Outcome) -> str:
    """How a case failed: a hang or dead rank, an error that is not a clear autopar refusal (by the
    exception's type), a forced option the plan dropped, or training that differs from one device."""
    d = outcome.detail
    if d.startswith("ranks did not all return"):
        return "hang"
    if "not a clear autopar refusal" in d:
        found = re.search(r"\b(\w*(?:Error|Exception))\b", d.split("\n", 1)[-1])
        return "error " + (found.group(1) if found else "")
    if d.startswith("the plan did not keep"):
        return "options"
    return "training differs"


def _mlp(spec: MLPSpec) -> Iterator[MLPSpec]:
    r = spec.__class__
    n = len(spec.widths)
    for i in range(n if n > 1 else 0):
        yield r(spec.d_in, spec.widths[:i] + spec.widths[i + 1:], spec.acts[:i] + spec.acts[i + 1:],
                spec.bias[:i] + spec.bias[i + 1:], spec.classes, spec.head_bias)
    for i in range(n):
        for w in (4, 8):
            if w < spec.widths[i]:
                yield r(spec.d_in, spec.widths[:i] + (w,) + spec.widths[i + 1:], spec.acts, spec.bias, spec.classes,
                        spec.head_bias)
        for act in ("identity", "relu"):
            if spec.acts[i] != act:
                yield r(spec.d_in, spec.widths, spec.acts[:i] + (act,) + spec.acts[i + 1:], spec.bias, spec.classes,
                        spec.head_bias)
                break
        if spec.bias[i]:
            yield r(spec.d_in, spec.widths, spec.acts, spec.bias[:i] + (False,) + spec.bias[i + 1:], spec.classes,
                    spec.head_bias)
    if spec.head_bias:
        yield r(spec.d_in, spec.widths, spec.acts, spec.bias, spec.classes, False)
    for field, small in (("d_in", 3), ("classes", 2)):
        if getattr(spec, field) > small:
            yield _with(spec, **{field: small})


def _with(spec, **kw):
    return dataclasses.replace(spec, **kw)


def _transformer(spec: TransformerSpec) -> Iterator[TransformerSpec]:
    if spec.layers > 1:
        yield _with(spec, layers=spec.layers - 1)
    if spec.heads > 1:
        yield _with(spec, heads=1)
    for hidden in (spec.heads * 2, spec.heads * 4):
        if hidden < spec.hidden and (spec.norm == "rms" or hidden >= 4):
            yield _with(spec, hidden=hidden)
    for field, small in (("ffn", 8), ("seq", 2), ("vocab", 11)):
        if getattr(spec, field) > small:
            yield _with(spec, **{field: small})
    for field, plain in (("tied", False), ("fused_qkv", True), ("bias", False), ("norm", "rms"), ("act", "relu")):
        if getattr(spec, field) != plain:
            yield _with(spec, **{field: plain})


def _smaller_meshes(case: Case) -> Iterator[tuple[tuple[int, ...], tuple[str, ...] | None]]:
    if len(case.shape) == 2:
        for i in range(2):
            yield (2,), (case.axis_names[i],) if case.axis_names else None
    elif case.shape[0] > 1:
        yield (case.shape[0] // 2,), case.axis_names


def simpler(case: Case) -> Iterator[Case]:
    """One-step simplifications of ``case``, the ones that remove most first."""
    if case.mode == "hybrid":
        yield case.replace(mode=case.source, source="")
    for i in range(len(case.shards)):
        yield case.replace(shards=case.shards[:i] + case.shards[i + 1:])
    if case.stages:
        yield case.replace(stages=())
    for field, plain in (("memory_fraction", None), ("mixed_precision", None), ("zero", None), ("recompute", None),
                         ("accumulation", None), ("clip", None), ("optim", "sgd"), ("steps", 1)):
        if getattr(case, field) != plain:
            yield case.replace(**{field: plain})
    if case.micro > 1:
        yield case.replace(micro=1, batch=case.batch // case.micro)
    for shape, names in _smaller_meshes(case):
        axes = set(names or [f"d{i}" for i in range(len(shape))])
        yield case.replace(shape=shape, axis_names=names, shards=tuple(a for a in case.shards if a.axis in axes),
                           stages=case.stages if names and "pp" in names else ())
    models = _mlp(case.model) if case.model.family == "mlp" else _transformer(case.model)
    for spec in models:
        yield case.replace(model=spec)
    half = case.batch // 2
    if case.batch % 2 == 0 and half % case.micro == 0 and (case.accumulation is None
                                                           or (half // case.micro) % case.accumulation == 0):
        yield case.replace(batch=half)


def shrink(case: Case, fails: Callable[[Case], bool], budget: int = 60) -> tuple[Case, int]:
    """(the smallest case found that ``fails``, the number of candidate runs spent)."""
    runs, progress = 0, True
    while progress and runs < budget:
        progress = False
        for candidate in simpler(case):
            if runs >= budget:
                break
            runs += 1
            if fails(candidate):
                case, progress = candidate, True
                break
    return case, runs
