"""A lower bound on a pipeline candidate's step time, known before its solves (AUTO's branch and bound
over pipeline candidates, ``pipeline_search.pipeline_plans``).

For a candidate (pp, sub-mesh S), ``plan_pipeline`` returns a plan whose step is

    simulate(schedule).critical_path + max_r (sync_r + opt_r) + the last gradient bucket

over the units of one intra-op plan of S at m microbatches of B / m rows. The busiest rank runs at
least 1 / pp of the units' work (every unit's forward and backward for each of the m microbatches,
each on one rank; the bubble and the hops only add) and of their gradient syncs and optimizer steps.
So its step is at least T_m / pp, where T_m = m x (one microbatch's costs) + (once-per-step costs) is
the whole model's step on S under that plan, and T_m is at least the unbudgeted optimum of the
whole model on S at the global batch B with one microbatch (``step_floor``): the cost model charges
m microbatches of B / m rows at least what it charges one of B (kernel launches and collective
latencies repeat; the bound ``search._frontier`` rests on too), and a memory budget only removes
assignments. A candidate whose floor reaches the best plan so far (``progress.cutoff``) cannot beat
it and is not solved (``PipelineDominatedError``, listed among the plan's alternatives).

The floor is one unbudgeted solve of the traced step on S (no re-trace, no memory loop); it is used
only when that solve is proven optimal. ``AUTOPAR_PIPELINE_BOUND=0`` turns the pruning off (tests
compare the search with and without it).
"""
from __future__ import annotations

import dataclasses
import math
import os

from autopar.cost_models.memory import param_numel, parameter_nodes, training_state_bytes
from autopar.plan.plan import PlanError
from autopar.solver.intra_op import InfeasibleError, SolverTimeoutError
from autopar.solver.mesh_solve import solve_on_mesh
from autopar.solver.pipeline_fit import PipelineDominatedError, budget_bytes
from autopar.solver.request import SolveRequest

BOUND_ENV = "AUTOPAR_PIPELINE_BOUND"
UNBOUNDED_GB = 1e6      # the memory budget of the floor's solve: no layout is refused for memory


def bounds_enabled() -> bool:
    """Whether AUTO prunes pipeline candidates by ``step_floor`` (``AUTOPAR_PIPELINE_BOUND=0``: off)."""
    return os.environ.get(BOUND_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def step_floor(traced, cand, mode, opts, param_ann: dict, input_ann: dict) -> float:
    """A lower bound (seconds) on the step of any plan ``plan_pipeline`` returns for ``cand`` (module
    docstring): the sub-mesh's unbudgeted whole-model optimum at the traced (global) batch, less its
    last-bucket latency, over pp. 0.0 when no proven optimum is at hand (a timed-out or failed solve)."""
    per_node = min(cand.full.size, cand.full.gpus_per_node or cand.full.size)
    loose = dataclasses.replace(opts, memory_budget_gb=UNBOUNDED_GB, progress=None)
    try:
        plan = solve_on_mesh(SolveRequest(traced, None, cand.sub, mode, loose, param_ann, input_ann),
                             microbatches=1, ranks_per_node=per_node)
    except (InfeasibleError, SolverTimeoutError, PlanError, ValueError):
        return 0.0                  # the candidate's own solves say what is wrong
    if plan.solver_status != "OPTIMAL":
        return 0.0
    return max(0.0, plan.step_time - plan.grad_sync_overhead) / cand.pp


def candidate_floors(traced, cands: list, mode, opts, param_ann: dict, input_ann: dict, keep) -> dict[int, float]:
    """``id(cand)`` -> ``step_floor`` for each candidate ``keep(cand)`` allows (the others are refused
    or skipped without a solve anyway)."""
    return {id(c): step_floor(traced, c, mode, opts, param_ann, input_ann) for c in cands if keep(c)}


def by_floor(traced, cands: list, floors: dict[int, float], opts) -> list:
    """``cands`` by floor ascending (stable), those whose training state fits the cap over their
    model-parallel devices first (``pipeline_fit.model_parallel_first``'s two parts, whose floors,
    blind to memory, say least about the plan): the candidate likeliest to be best is solved first,
    so that its plan bounds the rest."""
    params = parameter_nodes(traced.gm)
    state = training_state_bytes(param_numel(traced.gm), params[0].meta["val"].dtype, opts.optimizer,
                                 opts.precision) if params else 0.0

    def spills(cand) -> bool:
        dp = cand.sub.shape[cand.sub.axis_names.index("dp")] if "dp" in cand.sub.axis_names else 1
        return state / (cand.pp * cand.sub.size // dp) > budget_bytes(cand, opts)
    return sorted(cands, key=lambda c: (spills(c), floors.get(id(c), 0.0)))


def floor_dominated(floor: float | None, cutoff: float | None) -> PipelineDominatedError | None:
    """The reason a candidate of step floor ``floor`` is not solved, when it reaches ``cutoff`` (the step a
    plan must beat to be kept, ``SearchProgress.cutoff``); None when it may still win."""
    if floor is None or cutoff is None or not math.isfinite(cutoff) or floor < cutoff:
        return None
    return PipelineDominatedError(
        f"cannot beat the best plan so far ({cutoff:.4g} s): a lower bound on its step is {floor:.4g} s (the "
        "sub-mesh's unbudgeted whole-model step at the global batch over the pipeline's stages); not solved")
