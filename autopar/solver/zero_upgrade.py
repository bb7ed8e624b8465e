"""ZeRO-1 for the fastest pipelined plan found below it (AUTO/SEMI_AUTO with ``zero`` left to the search).

``make_plans`` climbs the ZeRO ladder (``accumulation.zero_ladder``) and stops above the first stage
whose plan fits freely: a higher stage then only adds collectives to a layout that already fits.
In a pipeline ZeRO-1 adds none: the gradients are summed once after the schedule either way
(``runtime/pipeline_zero.py``: a reduce-scatter and an all-gather of the updated shards, the
all-reduce's ring bytes), and the optimizer step runs on ``1/d`` of the state, so it can be the
faster plan where ZeRO-0 fits (Megatron-LM's published pipelined layouts use its distributed
optimizer). ``zero1_plans`` re-plans the best plan's pipeline candidate (its named ``pp`` mesh,
recomputation) at ZeRO-1: one probe, not a second ladder; the usual ranking then picks.

Without a pipeline ZeRO-1 stays a memory lever (the ladder): its all-gather after the step is
exposed where DDP's all-reduce overlaps backward, and trying it on every data-parallel job would
change the default plan of jobs that fit.
"""
from __future__ import annotations

from autopar.core.context import ParallelMode
from autopar.cost_models.zero import PIPELINE_ZERO
from autopar.plan.plan import Plan, PlanError
from autopar.solver.accumulation import accumulated, microbatch_traced
from autopar.solver.intra_op import DominatedError, InfeasibleError, SolverTimeoutError
from autopar.solver.request import SolveRequest


def applies(req: SolveRequest, tried: set[int], best_tried: bool = True) -> bool:
    """Whether the search may add the ZeRO-1 probe: AUTO/SEMI_AUTO, the stage left to the search,
    more than one device, and stage 1 not already searched (``tried``: the stages whose frontier ran)
    or its frontier not having tried the best plan's pipeline at its recomputation (``best_tried``
    false: a pipeline retried with more recomputation at ZeRO-0 after the ZeRO-1 frontier had dropped it
    at a lighter choice, ``search._retries``)."""
    return (req.opts.zero is None and req.mode in (ParallelMode.AUTO, ParallelMode.SEMI_AUTO)
            and req.mesh.size > 1 and (1 not in tried or not best_tried))


def zero1_plans(req: SolveRequest, best: Plan, traces: dict, candidates) -> list[Plan]:
    """Plans of ``best``'s pipeline candidate at ZeRO-1 (module docstring); [] where ``best`` is not a
    pipeline at ZeRO-0. ``candidates``: ``search._candidates``; ``traces``: accumulation
    k -> the step traced at B/k."""
    if best.memory_options.zero != 0 or best.pipeline is None or 1 not in PIPELINE_ZERO:
        return []
    progress = req.opts.progress
    k = best.memory_options.accumulation
    if k not in traces:
        traces[k] = microbatch_traced(req.traced, k, req.retracer)
    mb = traces[k]
    recompute = best.memory_options.recompute
    if progress is not None:
        progress.enter(f"ZeRO-1 on the best pipeline (mesh {best.mesh.shape})")
    probe = req.replace(traced=mb, mesh=best.mesh).with_options(zero=1, recompute=recompute)
    try:
        found, _, _ = candidates(probe, pipelines=True, microbatches=k)
    except (PlanError, InfeasibleError, DominatedError, SolverTimeoutError):
        return []
    found = [p for p in found if p.pipeline is not None]
    return [accumulated(p, k, req.traced, mb) for p in found]
