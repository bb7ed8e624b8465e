"""A lower bound on a pipeline candidate's step time, known before its solves (AUTO's branch and bound
over pipeline candidates, ``pipeline_search.pipeline_plans``).

For a candidate (pp = p, sub-mesh S), ``plan_pipeline`` returns a plan whose step is

    simulate(schedule).critical_path + max_r (sync_r + opt_r) + the last gradient bucket

over the units of one intra-op plan of S at m microbatches of B / m rows, cut into S' = p·v stages
(stage s on rank s mod p). Its units' work per microbatch W (forward and backward, each unit once)
and its once-per-step costs O (gradient syncs, optimizer steps; each on one rank, so the fullest
rank holds at least O / p) are those of the whole model's step on S under that plan,
T_m = m·W + O, and so (``step_floor``) m·W >= E and O >= O_B, where E + O_B is the unbudgeted
optimum of the whole model on S at the global batch B with one microbatch, split into its
per-microbatch part E and once-per-step part O_B: the cost model charges m microbatches of B / m rows
at least what it charges one of B (kernel launches and collective latencies repeat; the bound
``search._frontier`` rests on too), and a memory budget only removes assignments.

The critical path (``schedule_factor``): in any schedule, with stage times t_s (sum W), a rank r
can start its first action of chunk c (stage s = r + c·p) only once some microbatch has run the
stages before s, and before that it can only run forwards of its lower chunks; after its last
chunk-c action it can only run backwards of its lower chunks while the backward runs down stages
s-1 .. 0. So the step is at least sum_{s' < s} t_s' + m · sum_{c' >= c} t_{r + c'p} for every
stage s. The least over all t >= 0 of the largest of these (a small LP, per (p, v, m)) is x·W;
it is m·W / p with no bubble at the least, and (m + p - 1)-like for one stage per rank.

    floor = E · min_{v, m} x(p, v, m) / m + O_B / p

over the stages per rank the search tries (``VIRTUAL_STAGES``) and its microbatch counts. A
candidate whose floor reaches the best plan so far (``progress.cutoff``) cannot beat it and is not
solved (``PipelineDominatedError``, listed among the plan's alternatives).

The floor costs one unbudgeted solve of the traced step on S (no re-trace, no memory loop); it is
used only when that solve is proven optimal. The floors are on only with ``AUTOPAR_PIPELINE_BOUND=1``
(then every candidate's floor is solved first and the candidates are tried by floor ascending): on
Llama-3 8B over 64 H100s they were 0.55-0.88 of the solved steps, and every candidate lies within 1.3x of
the best plan, so none is pruned and the floors' solves only add time (bench/RESULTS.md §35m).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os

from ortools.linear_solver import pywraplp

from autopar.cost_models.memory import param_numel, parameter_nodes, training_state_bytes
from autopar.graph.cut_points import assign_units
from autopar.plan.plan import PlanError
from autopar.solver.intra_op import InfeasibleError, SolverTimeoutError
from autopar.solver.mesh_solve import solve_on_mesh
from autopar.solver.pipeline_fit import (PipelineDominatedError, PipelineRequestError, budget_bytes, microbatch_counts,
                                         model_parallel_size)
from autopar.solver.request import SolveRequest
from autopar.solver.virtual_stages import virtual_stage_choices

BOUND_ENV = "AUTOPAR_PIPELINE_BOUND"
UNBOUNDED_GB = 1e6      # the memory budget of the floor's solve: no layout is refused for memory
VIRTUAL_STAGES = {"gpipe": (1,), "1f1b": (1,), "interleaved_1f1b": (2,)}   # the schedules; interleaved: see below


def stages_per_rank(kind: str, pp: int, m: int, units: int, opts) -> list[int]:
    """Every stages-per-rank value the search may cut ``kind`` at (``virtual_stages.virtual_stage_choices``:
    the floor is a minimum over them, so covering each keeps it sound)."""
    if kind != "interleaved_1f1b":
        return list(VIRTUAL_STAGES[kind])
    return virtual_stage_choices(pp, m, units, getattr(opts, "virtual_stages", None))
                        # the search tries (``inter_op._prepare``): a search that tries more must list them here
SAFETY = 1e-6           # the LP's optimum is shaded by this share (its tolerance)


def bounds_enabled() -> bool:
    """Whether AUTO orders and prunes pipeline candidates by ``step_floor``: only with
    ``AUTOPAR_PIPELINE_BOUND=1`` (off by default: on the jobs measured, bench/RESULTS.md §35m, the
    floors cost a solve each and pruned too little to pay for it)."""
    return os.environ.get(BOUND_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def step_floor(traced, cand, mode, opts, param_ann: dict, input_ann: dict) -> float:
    """A lower bound (seconds) on the step of any plan ``plan_pipeline`` returns for ``cand`` (module
    docstring). 0.0 when no proven optimum is at hand (a timed-out or failed solve)."""
    per_node = min(cand.full.size, cand.full.gpus_per_node or cand.full.size)
    loose = dataclasses.replace(opts, memory_budget_gb=UNBOUNDED_GB, progress=None)
    dp = cand.sub.shape[cand.sub.axis_names.index("dp")] if "dp" in cand.sub.axis_names else 1
    try:
        counts = microbatch_counts(traced.batch_size, dp, opts)
        plan = solve_on_mesh(SolveRequest(traced, None, cand.sub, mode, loose, param_ann, input_ann),
                             microbatches=1, ranks_per_node=per_node)
    except (InfeasibleError, SolverTimeoutError, PlanError, PipelineRequestError, ValueError):
        return 0.0                  # the candidate's own solves say what is wrong
    if plan.solver_status != "OPTIMAL":
        return 0.0
    once = max(0.0, plan.once_per_step_time - plan.grad_sync_overhead)
    every = max(0.0, plan.step_time - plan.once_per_step_time)
    kinds = [opts.schedule] if opts.schedule in VIRTUAL_STAGES else list(VIRTUAL_STAGES)
    units = len(assign_units(traced.gm, ends=True)[0])    # every v the search may cut at (``end_units``)
    factor = min(schedule_factor(cand.pp, v, m) / m for kind in kinds for m in counts
                 for v in stages_per_rank(kind, cand.pp, m, units, opts))
    return every * factor + once / cand.pp


@functools.lru_cache(maxsize=4096)
def schedule_factor(p: int, v: int, m: int) -> float:
    """x(p, v, m): the least critical path, over every split of one microbatch's work (sum 1) into p·v
    stages (stage s on rank s mod p), of any schedule of m microbatches (module docstring), shaded by
    ``SAFETY``; at least m / p."""
    if p == 1:
        return float(m)
    n = p * v
    lp = pywraplp.Solver.CreateSolver("GLOP")
    t = [lp.NumVar(0.0, 1.0, f"t{s}") for s in range(n)]
    x = lp.NumVar(0.0, lp.infinity(), "x")
    lp.Add(sum(t) == 1.0)
    for s in range(n):
        lp.Add(sum(t[:s]) + m * sum(t[q] for q in range(s, n, p)) <= x)
    lp.Minimize(x)
    if lp.Solve() != pywraplp.Solver.OPTIMAL:
        return m / p
    return max(m / p, x.solution_value() * (1 - SAFETY))


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
        return state / (cand.pp * model_parallel_size(cand.sub)) > budget_bytes(cand, opts)
    return sorted(cands, key=lambda c: (spills(c), floors.get(id(c), 0.0)))


def floor_dominated(floor: float | None, cutoff: float | None) -> PipelineDominatedError | None:
    """The reason a candidate of step floor ``floor`` is not solved, when it reaches ``cutoff`` (the step a
    plan must beat to be kept, ``SearchProgress.cutoff``); None when it may still win."""
    if floor is None or cutoff is None or not math.isfinite(cutoff) or floor < cutoff:
        return None
    return PipelineDominatedError(
        f"cannot beat the best plan so far ({cutoff:.4g} s): a lower bound on its step is {floor:.4g} s (the "
        "sub-mesh's unbudgeted whole-model step at the global batch over the pipeline's stages); not solved")
