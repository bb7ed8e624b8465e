"""ZeRO-1 under accumulation reduce-scatters each parameter's gradient once per step; ZeRO-2 in every
microbatch (issue 32). The report lists once-per-step and per-microbatch collectives on separate
lines, so a weight stored split over ``dp`` and gathered in every microbatch (whose backward
reduce-scatters its gradient k times) is not read as ZeRO's reduce-scatter."""
from __future__ import annotations

import re

import pytest

import autopar
from autopar.report.text import render
from examples.factories import gpt

K = 4


def _plan(zero: int):
    model, inputs, loss, target = gpt(hidden=64, layers=2, heads=4, seq=16, batch=16, vocab=256)
    autopar.set_auto_parallel_context(zero=zero, accumulation=K, recompute="none")
    try:
        return autopar.plan(model, autopar.Mesh((4,), axis_names=("dp",), device="v100-16gb"),
                            example_inputs=inputs, loss_fn=loss, example_target=target, mode="data")
    finally:
        autopar.reset_auto_parallel_context()


@pytest.mark.parametrize("zero,runs", [(1, 1), (2, K)])
def test_a_parameters_reduce_scatter_runs_once_per_step_under_zero1(zero, runs):
    plan = _plan(zero)
    params = {d.placeholder for d in plan.params.values() if d.kind == "parameter" and d.trainable}
    grads = [c for c in plan.collectives(0) if c.kind == "reduce_scatter" and c.node in params]
    assert grads, "no ZeRO reduce-scatter in the plan"
    assert {plan.runs_per_step(c) for c in grads} == {runs}
    lines = render(plan).split("collectives per step on rank 0: ")[1].splitlines()
    total = int(lines[0])
    assert total == sum(plan.runs_per_step(c) for c in plan.collectives(0))
    listed = {}
    for line in lines[1:]:
        m = re.match(r"\s+(\w+)\s+axis (\S+)\s+(\w+)\s+×(\d+)\s.*?(?:\((\d+) × (\d+) microbatches\))?$", line)
        if not m:
            break
        kind, axes, phase, n, per, k = m.groups()
        assert int(per or n) * int(k or 1) == int(n)
        listed[(kind, axes, phase, int(k or 1))] = int(n)
    rs = sum(1 for c in grads if c.axes == ["dp"])
    assert listed[("reduce_scatter", "dp", "bwd", runs)] >= rs * runs
    assert sum(listed.values()) == total
