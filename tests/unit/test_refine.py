"""The probes after the frontiers (``solver/refine.py``): ZeRO-1 and partial recomputation refine the best
plan and the runner-up pipeline of another mesh within ``RUNNER_UP`` of it."""
from __future__ import annotations

import autopar
import autopar.solver.refine as refine
from autopar.core.context import ParallelMode
from autopar.plan.plan import MemoryOptions, PipelineInfo, Plan
from autopar.solver.request import PlanOptions, SolveRequest
from autopar.solver.search import rank_key


def _plan(pp: int, step: float, recompute: str = "full", zero: int = 0, pipeline: bool = True) -> Plan:
    mesh = autopar.Mesh((pp, 16 // pp), axis_names=("pp", "dp")) if pipeline else autopar.Mesh((16,), axis_names=("dp",))
    return Plan(mode=ParallelMode.AUTO, mesh=mesh, degrees={"pp": pp}, axis_roles={"dp": "dp"}, step_time=step,
                pipeline=PipelineInfo(1, "x") if pipeline else None,
                memory_options=MemoryOptions(recompute=recompute, zero=zero))


def test_the_runner_up_is_the_fastest_full_recompute_pipeline_of_another_mesh_close_behind():
    best = _plan(8, 15.04, zero=1)
    close, closer = _plan(16, 15.27), _plan(4, 15.10)
    far, partial, flat = _plan(2, 15.04 * (1 + refine.RUNNER_UP) * 1.01), _plan(16, 15.05, "none"), \
        _plan(1, 15.06, pipeline=False)
    same_mesh = _plan(8, 15.05)
    assert refine.runner_up([best, close, closer, far, partial, flat, same_mesh], best, rank_key) is closer
    assert refine.runner_up([best, close], best, rank_key) is close
    assert refine.runner_up([best, far, partial, flat, same_mesh], best, rank_key) is None


def test_both_anchors_are_refined_each_after_its_zero1_probe(monkeypatch):
    """ZeRO-1 runs on each anchor, partial recomputation on the faster of each anchor and its ZeRO-1 plans."""
    best, close = _plan(8, 15.04, zero=1), _plan(16, 15.27)
    upgraded = _plan(16, 15.10, zero=1)
    calls = []

    def zero1(req, anchor, traces, candidates):
        calls.append(("zero1", anchor))
        return [upgraded] if anchor is close else []

    def partial(req, anchor, traces, candidates):
        calls.append(("partial", anchor))
        return []
    monkeypatch.setattr(refine, "zero1_plans", zero1)
    monkeypatch.setattr(refine, "partial_plans", partial)
    req = SolveRequest(None, None, autopar.Mesh(16), ParallelMode.AUTO, PlanOptions(), {}, {})
    out = refine.refined(req, [best, close], {0}, lambda p: False, None, {}, rank_key)
    assert out == [upgraded]
    assert calls == [("zero1", best), ("partial", best), ("zero1", close), ("partial", upgraded)]
