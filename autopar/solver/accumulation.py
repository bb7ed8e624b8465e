"""Gradient accumulation as a plan choice: the global batch B runs as k microbatches of B/k rows
one after another, gradients summed locally and synchronised once (DDP's ``no_sync`` idiom).

A plan with accumulation k is solved on the step traced at B/k rows, so the intra-op problem sees
one microbatch's activations (what must fit) and one microbatch's compute. Its step time is

    T(k) = k · (T_mb − T_once) + T_once,   T_once = gradient sync + last bucket + optimizer step
                                                    + ZeRO-1/2's weight gathers
                                           (ZeRO-2: the reduce-scatter runs per microbatch, so not in
                                           T_once; ZeRO-3: the optimizer step only; ``Plan.once_per_step_time``)

where T_mb is the solved microbatch plan's time: everything but the once-per-step part runs k
times. The intra-op solver minimises T(k) itself, not T_mb (``BuiltProblem.per_step``: each
node's once-per-step seconds weigh 1/k), so a layout is not chosen for a gradient sync it pays
once as if it paid it k times. Memory is the microbatch plan's (parameters, gradients and optimizer state do not depend on
k). ``accumulation_ladder`` gives the k to try: the user's, or, for AUTO and SEMI_AUTO, 1 and then
powers of two while nothing fits (the smallest k that fits is the fastest: T grows with k).
"""
from __future__ import annotations

from autopar.core.context import ParallelMode
from autopar.cost_models.zero import PIPELINE_ZERO
from autopar.graph.retrace import Retracer, graph_fingerprint, microbatch_trace
from autopar.plan.plan import MicrobatchTrace, Plan, PlanError


def memory_choices(batch: int, mode: ParallelMode, accumulation: int | None,
                   recompute) -> tuple[list[int], list]:
    """(the accumulation k to try, ascending; the recomputation choices to try, cheapest first).

    Both levers trade time for memory and neither dominates: accumulation k re-runs the per-step
    overheads k times, recomputation re-runs a layer's forward. The search finds, for each
    recompute choice r, the smallest k that fits (``k_r``; ``T`` grows with k) and keeps the
    fastest of those frontier points. Since more recomputation only pays if it fits at a smaller
    k, choice r is tried only below the previous choices' ``k_r``. A user-fixed value is the only
    one tried; modes other than AUTO/SEMI_AUTO do not recompute unless told to."""
    ks, _ = accumulation_ladder(batch, mode, accumulation)
    if recompute is not None:
        return ks, [recompute]
    if mode not in (ParallelMode.AUTO, ParallelMode.SEMI_AUTO):
        return ks, ["none"]
    return ks, ["none", "selective", "full"]


ZERO3_COMPILED = ("zero=3 does not run compiled yet (compile=True): its per-layer gathers and saved-tensor hooks "
                  "do not trace; use zero=0, 1 or 2 with compile=True, or compile=False with zero=3")


def zero_ladder(mode: ParallelMode, zero: int | None, compiled: bool = False) -> list[int]:
    """The ZeRO stages to try, in order: the user's, or for AUTO/SEMI_AUTO 0, 1, 2, 3. The
    search runs the accumulation frontier of each stage at one recompute choice, every stage
    before the next choice (the cheaper lever first), and keeps the fastest plan of all; it drops
    the stages above the first one whose plan fits without accumulation or recomputation
    and without the cap shaping its layout (``Plan.memory_bound``): a higher stage then only adds
    collectives (ZeRO-1, which adds none to a pipeline and shards its optimizer step, is then tried
    on the best pipelined plan's candidate: ``zero_upgrade.py``). ``compiled`` (compile=True): ZeRO-3 does not run compiled yet
    (``runtime.zero.check_zero_supported``), so the ladder stops at 2. A pipeline runs stages 0 and 1
    (``pipeline_zero_ladder``)."""
    if zero is not None:
        if zero not in (0, 1, 2, 3):
            raise PlanError(f"zero={zero!r} is not a ZeRO stage; use 0, 1, 2 or 3")
        if compiled and zero == 3:
            raise PlanError(ZERO3_COMPILED)
        return [zero]
    return ([0, 1, 2] if compiled else [0, 1, 2, 3]) if mode in (ParallelMode.AUTO, ParallelMode.SEMI_AUTO) else [0]



def pipeline_zero_ladder(stages: list[int], zero: int | None) -> list[int]:
    """``zero_ladder``'s stages for a request that names a pipeline: those a pipeline runs
    (``cost_models.zero.PIPELINE_ZERO``: ZeRO-1 shards the optimizer state and sums the gradients
    once after the schedule; ZeRO-2 and 3 would reduce-scatter or gather in every microbatch, as
    DeepSpeed refuses them with pipelines too). A user's stage 2 or 3 is a PlanError."""
    if zero is not None and zero not in PIPELINE_ZERO:
        raise PlanError(f"zero={zero} is not supported with a pipeline (a 'pp' mesh axis, microbatches or schedule): "
                        "ZeRO-2 and 3 would reduce-scatter or gather every microbatch; use zero=1 (optimizer state "
                        "sharded over the data-parallel ranks) or zero=0 for pipelined plans, or drop the pipeline")
    return [z for z in stages if z in PIPELINE_ZERO]


def accumulation_ladder(batch: int, mode: ParallelMode, forced: int | None) -> tuple[list[int], bool]:
    """(the k to try in order, whether the user fixed k)."""
    if forced is not None:
        if not isinstance(forced, int) or forced < 1:
            raise PlanError(f"accumulation={forced!r} must be a positive int (1: none)")
        if batch % forced:
            raise PlanError(f"accumulation={forced} does not divide the global batch {batch}; use a divisor of "
                            f"{batch} (e.g. {', '.join(str(k) for k in range(1, batch + 1) if batch % k == 0)})")
        return [forced], True
    if mode not in (ParallelMode.AUTO, ParallelMode.SEMI_AUTO):
        return [1], False
    ladder, k = [1], 2
    while k <= batch and batch % k == 0:
        ladder.append(k)
        k *= 2
    return ladder, False


def microbatch_traced(traced, k: int, retracer: Retracer | None):
    """The step traced at B/k rows (``traced`` itself for k = 1)."""
    if k == 1:
        return traced
    if retracer is None:
        raise PlanError("planning with gradient accumulation re-traces the model at the microbatch shape; "
                        "use autopar.plan()/parallelize(), which make a Retracer")
    return microbatch_trace(traced, traced.batch_size // k, retracer)


def accumulated(plan: Plan, k: int, traced, mb) -> Plan:
    """``plan`` (solved on the microbatch graph ``mb``) as a plan for the whole step of ``traced``."""
    if k == 1:
        return plan
    plan.step_time = accumulated_time(plan, k)
    plan.flops *= k
    plan.memory_options.accumulation = k
    plan.accumulation_trace = MicrobatchTrace(mb.batch_size, graph_fingerprint(mb.gm))
    plan.fingerprint = graph_fingerprint(traced.gm)
    return plan


def accumulated_time(plan: Plan, k: int) -> float:
    """T(k) of the module docstring for a plan solved on one microbatch."""
    if k == 1:
        return plan.step_time
    once = plan.once_per_step_time
    return k * (plan.step_time - once) + once
