"""From a traced model, a mesh and a mode to a Plan.

DATA fixes inputs to Shard(0) on every axis and parameters to Replicate; SEMI_AUTO fixes
what the annotations name; AUTO leaves everything free and, for an unnamed mesh, tries every
factorisation of the devices into (dp, tp) meshes, keeping the best predicted step time that
fits memory (the others go to ``plan.alternatives``). The same intra-op solver completes
every mode.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time

from autopar.core.context import ParallelMode
from autopar.cost_models.memory import param_numel, parameter_nodes, training_state_bytes, training_state_parts
from autopar.graph.buffer_writes import updates_buffers
from autopar.graph.chunk_hints import mark_chunk_hints
from autopar.core.mesh import Mesh
from autopar.plan.plan import Alternative, CandidateError, Plan, PlanError
from autopar.sharding.placements import R
from autopar.solver.accumulation import (accumulated, accumulated_time, memory_choices, microbatch_traced,
                                        pipeline_zero_ladder, zero_ladder)
from autopar.cost_models.zero import PIPELINE_ZERO
from autopar.solver.cp_candidates import MergedAxisWins, batch_merged, cp_meshes
from autopar.solver.fit_error import Failure, no_plan_error, smallest_of
from autopar.solver.intra_op import DominatedError, InfeasibleError, SolverTimeoutError
from autopar.solver.mesh_solve import PlanOptions, solve_on_mesh
from autopar.solver.pipeline_fit import PipelineDominatedError
from autopar.solver.candidate_order import flat_steps, node_order
from autopar.solver.pipeline_search import optimizer_time, pipeline_plans, pipeline_requested
from autopar.solver.attention_kept import kept_probes
from autopar.solver.partial_recompute import applies as partial_applies, partial_plans, resolve_recompute_layers
from autopar.solver.progress import SearchProgress
from autopar.solver.request import SolveRequest
from autopar.solver.zero_upgrade import applies as zero1_applies, zero1_plans
from autopar.solver.zero_floor import zero1_floor, zero1_slack
from autopar.cost_models.devices import mesh_device


# each solve's unbudgeted floor drops its mesh at later accumulations and recomputation once the best
# plan beats it (``_floored``); off (``AUTOPAR_STEP_FLOORS=0``) for the tests that compare plans
STEP_FLOORS: bool = os.environ.get("AUTOPAR_STEP_FLOORS", "1") != "0"


@dataclasses.dataclass
class FrontierState:
    """One ZeRO stage's branch-and-bound facts, kept across recompute choices (``_frontier``)."""
    done: dict = dataclasses.field(default_factory=dict)   # mesh key -> index into ks from which it cannot win
    pipe_fit: set = dataclasses.field(default_factory=set)  # pipeline candidates (full mesh key) that fit
    early: set = dataclasses.field(default_factory=set)     # recompute choices whose pipelines ran before the ladder
    fitting: bool = False                                   # a plan of this stage fits (at any choice so far)
    floors: dict = dataclasses.field(default_factory=dict)  # mesh key -> [(k index, whole-step floor proven there)]
    retry: dict = dataclasses.field(default_factory=dict)   # pipeline (full mesh key) -> its step without the cap
                                                            # (``_retries``): to try again with more recomputation
    pipes: set = dataclasses.field(default_factory=set)     # (full mesh key, recompute choice) of pipelines tried


def candidate_meshes(mesh: Mesh, annotated: frozenset = frozenset(), traced=None) -> list[Mesh]:
    """An unnamed mesh may be re-factored into 1-D and 2-D (dp, tp) meshes: the free 1-D mesh
    (the solver picks each op's split) and every (dp, tp); with ``traced``, after them the meshes
    with a "cp" axis where its attention can split the sequence (``cp_candidates.py``). (DDP's layout joins them in
    ``make_plans``: ``ddp_candidate``.) ``annotated``: the axes the user's annotations name; only
    candidates with all of them are kept, the mesh as given first when it has them (its default
    names d0, d1, ...), and the mesh as given when none has them (its error names the axis)."""
    if mesh.named or mesh.size == 1:
        return [mesh]
    n = mesh.size
    out = [mesh.reshape((n,), ("d0",))]
    two_d = [mesh.reshape((dp, n // dp), ("dp", "tp")) for dp in range(2, n) if n % dp == 0]
    if mesh.gpus_per_node:
        two_d.sort(key=lambda m: node_order(m.shape[1], mesh.gpus_per_node))
    out += two_d + cp_meshes(traced, mesh)
    if not annotated:
        return out
    out = [m for m in out if annotated <= set(m.axis_names)]
    if annotated <= set(mesh.axis_names) and all((m.shape, m.axis_names) != (mesh.shape, mesh.axis_names) for m in out):
        out.insert(0, mesh)
    return out or [mesh]


def annotated_axes(param_ann: dict, input_ann: dict) -> frozenset:
    """The mesh axes the user's annotations place on (parameters and inputs)."""
    return frozenset(a for placements in (*param_ann.values(), *input_ann.values()) for a in placements)


NO_ACCUMULATION = ("Gradient accumulation was not tried: the model updates buffers in forward (e.g. BatchNorm "
                   "running statistics), so microbatches would be normalised with their own statistics; pass "
                   "accumulation=k to accept that.")


def make_plans(request: SolveRequest, top_k: int = 1) -> list[Plan]:
    """The ``top_k`` best predicted plans that fit memory, best first; each lists the others (and
    the candidates that failed) as its ``alternatives``. Pipeline candidates need ``request.retracer``."""
    t0 = time.perf_counter()
    request = resolve_recompute_layers(request)     # recompute_layers=k: its {layer: "full"} mapping
    traced, mesh, mode, opts = request.traced, request.mesh, request.mode, request.opts
    if opts.progress is None:
        opts = dataclasses.replace(opts, progress=SearchProgress())
    progress = opts.progress
    progress.keep = max(1, top_k)
    mark_chunk_hints(traced.gm)
    ks, choices = memory_choices(traced.batch_size, mode, opts.accumulation, opts.recompute)
    whole_batch = not opts.accumulation and len(ks) > 1 and updates_buffers(traced)
    if whole_batch:
        ks = ks[:1]                 # microbatches would change what the step computes (BatchNorm's statistics)
    if opts.accumulation and ks[0] > 1 and ("pp" in mesh.axis_names or opts.microbatches or opts.schedule):
        raise PlanError(f"accumulation={ks[0]} runs microbatches one after another without a pipeline, but this "
                        "request asks for a pipeline (a 'pp' mesh axis, microbatches or schedule): a pipeline already "
                        "runs the batch as microbatches, so set microbatches= instead of accumulation")
    stages = zero_ladder(mode, opts.zero, opts.compiled)
    if "pp" in mesh.axis_names or opts.microbatches or opts.schedule:
        stages = pipeline_zero_ladder(stages, opts.zero)    # ZeRO-0 or 1 with a pipeline (runtime/pipeline_zero.py)
        ks = ks[:1]                 # the pipeline runs the microbatches, not accumulation
    if stages[0] and mesh.size == 1:
        raise PlanError(f"zero={stages[0]} shards training state over a parameter's data-parallel replicas, but mesh "
                        f"{mesh!r} has 1 device: there is nothing to shard it over; use zero=0 (or leave zero unset) "
                        "on one device")
    plans, failures, pipe_failures, traces = [], [], [], {}
    request = request.replace(opts=opts)
    frontiers = {z: FrontierState() for z in stages if not (z and mesh.size == 1)}
    tried = set()                   # the ZeRO stages whose frontier ran
    for rc in choices:              # cheapest lever first: every ZeRO stage before more recomputation
        for z, state in frontiers.items():
            if progress.out_of_time():
                break
            tried.add(z)
            got, failed, pipe_failed = _frontier(request.with_options(zero=z), ks, choices, rc, traces, state)
            _share_floors(z, state, frontiers, request)
            plans += got
            failures += failed
            pipe_failures += pipe_failed
            if any(p.memory_options.accumulation == 1 and p.memory_options.recompute == "none" and not p.memory_bound
                   for p in got):
                frontiers = {y: s for y, s in frontiers.items() if y <= z}
                break               # fits freely: a higher stage only adds all-gathers
    if plans and zero1_applies(request, tried, _pipeline_tried(min(plans, key=rank_key), frontiers.get(1))) \
            and not progress.out_of_time():   # ZeRO-1 shards the optimizer step (before the bisection: its room)
        plans += zero1_plans(request, min(plans, key=rank_key), traces, _candidates)
    if plans and partial_applies(request) and not progress.out_of_time():   # "full" on fewer layers
        plans += partial_plans(request, min(plans, key=rank_key), traces, _candidates)
    if plans and partial_applies(request) and not progress.out_of_time():   # the attention core kept
        plans += kept_probes(request, plans, traces, _candidates, rank_key)
    if not plans:
        told = [(n, e) for n, e in pipe_failures if not isinstance(e, MergedAxisWins)]   # not solved: no reason
        err = no_plan_error(mesh, failures, told, _cap(mesh, opts), traced.batch_size, opts.time_limit_s)
        if whole_batch:
            err.args = (err.args[0] + " " + NO_ACCUMULATION,)
        raise err from None
    for p in plans:
        p.optimizer_time = optimizer_time(p, opts.optimizer)
    plans.sort(key=rank_key)
    chosen = [p for p in plans if not p.redundant_axes()] or plans   # none that wastes an axis while one does not
    failed = [Alternative({}, math.inf, math.inf, False, f"mesh {f.mesh.shape}: {f}") for f in failures]
    failed += [Alternative({}, math.inf, math.inf, False, f"{note}: {e}") for note, e in pipe_failures]
    failed.sort(key=lambda a: a.note)
    elapsed = time.perf_counter() - t0
    for best in chosen[:max(1, top_k)]:
        best.alternatives = [Alternative(p.degrees, p.step_time, max(p.memory_per_device), True,
                                         "mesh " + " × ".join(f"{n}={s}" for n, s in zip(p.mesh.axis_names, p.mesh.shape))
                                         + (f" ({p.candidate})" if p.candidate else ""),
                                         p.microbatches, p.schedule, p.optimizer_time, p.redundant_axes(),
                                         p.memory_options.summary())
                             for p in plans if p is not best] + failed
        best.solve_time = elapsed
        best.search_note = progress.stopped_note()
    return chosen[:max(1, top_k)]


def _share_floors(z: int, state: FrontierState, frontiers: dict, request: SolveRequest) -> None:
    """Hands the floors ZeRO stage ``z`` >= 1 proved (``FrontierState.floors``) to the higher stages.
    A layout's time under ZeRO-2 equals its time under ZeRO-1 at one microbatch (the same
    reduce-scatter of its gradients, one all-gather of its weights after the sharded optimizer step;
    the stages differ in memory only) and ZeRO-3 adds a second all-gather; with k microbatches
    stages 2 and 3 reduce-scatter in each (``strategy_prices._param_state_cost``, ``node_costs``).
    So a floor of stage ``z`` at any budget is one of every higher stage. From ZeRO-0, ZeRO-1 (which
    shards the optimizer step and may gather less than the all-reduce it replaces) gets the weaker
    floor ``zero_floor.zero1_floor``: half the ZeRO-0 floor less the most ZeRO-1 can save."""
    if z == 0 and 1 in frontiers and STEP_FLOORS:
        other = frontiers[1].floors
        for key, proven in state.floors.items():
            slack = zero1_slack(request.traced, key[0], request.mesh, request.opts)
            derived = [(j, f) for j, f in ((j, zero1_floor(f, slack)) for j, f in proven) if f > -math.inf]
            have = other.setdefault(key, [])
            have += [f for f in derived if f not in have]
    if z < 1:
        return
    for y, other in frontiers.items():
        if y > z:
            for key, proven in state.floors.items():
                have = other.floors.setdefault(key, [])
                have += [f for f in proven if f not in have]


def _cap(mesh: Mesh, opts: PlanOptions) -> float:
    """The per-device memory cap the candidates were solved under (bytes)."""
    return opts.memory_budget_gb * 2**30 if opts.memory_budget_gb else mesh_device(mesh).memory_bytes


def _frontier(req: SolveRequest, ks: list[int], choices: list, rc, traces: dict, state: FrontierState):
    """Branch and bound over (accumulation k, mesh) of ``req`` (the whole step) at recompute choice ``rc`` of
    ``choices``, k ascending
    (``accumulation.memory_choices``). A mesh stops being tried (``done``: from which k on) when

    * its plan at k fits without the cap shaping it (``Plan.memory_bound`` false): at a larger k,
      or with more recomputation, its step is at least that unbudgeted optimum again; or
    * its unbudgeted lower bound reaches the best plan so far (``DominatedError.unbudgeted``).

    Both rest on the cost model charging k microbatches of B/k rows at least what it charges one
    of B (launch and latency terms repeat) and recomputation only adding time, so an unbudgeted
    bound can only grow with k and with recomputation. A mesh that cannot fit at k, its least
    memory M(k) proven (``InfeasibleError.least_memory``), is not tried at k' < k · M(k) / cap:
    each layout's memory is S + A/k (state and gathered weights, activations of B/k rows, both
    >= 0), so the least over layouts is concave in 1/k and M(k') >= (k / k') · M(k). A bound under the budget
    (``DominatedError`` otherwise) drops the mesh at that k only: a larger k frees memory.
    Pipelines run their own microbatches (k = 1 only); with recomputation (``_pipeline_choice``) while no
    plan of this stage fits yet (or when a pipeline was asked for), a candidate until it fits with a stage
    cut the cap did not shape (``Plan.memory_bound``), after that only ``_retries``; and right after k = 1 when
    ``state_needs_pipeline`` (``_pipelines_first``): heuristics, not bounds (docs/solver.md). Every k
    is visited (a jump to the k one failed assignment's memory breakdown needs once skipped the k at
    which a faster layout fitted). ``traces``: k -> the step traced at B/k, shared across calls;
    ``state``: this ZeRO stage's bounds, carried from one recompute choice to the next
    (``make_plans`` runs every stage at one choice before the next choice, so that the cheap levers'
    plans bound the recomputed ones).
    (plans, failures, pipeline failures) as in :func:`_candidates`."""
    plans, failures, pipe_failures = [], [], []
    traced, mesh, opts = req.traced, req.mesh, req.opts
    progress = opts.progress
    keys = _mesh_keys(traced, mesh, req.mode, req.param_ann, req.input_ann)
    done, pipe_fit = state.done, state.pipe_fit
    pipeline_request = "pp" in mesh.axis_names or bool(opts.microbatches or opts.schedule)
    cap = _cap(mesh, opts)
    i = 0
    below: dict = {}            # mesh key -> the k under which it cannot fit (this recompute choice)
    while i < len(ks) and (any(done.get(key, len(ks)) > i for key in keys)
                           or ks[i] == 1 and state.fitting and bool(_retries(state, progress.cutoff()))):
        k = ks[i]
        if progress.out_of_time():
            return plans, failures, pipe_failures
        pipelines, pipe_only = _pipeline_choice(state, k, rc, opts, pipeline_request, progress.cutoff())
        if pipeline_request and not pipelines:
            break               # only pipelines were asked for
        progress.enter(", ".join([f"ZeRO-{opts.zero or 0}", f"recompute {rc}", f"accumulation {k}"]))
        mb = traces[k] = traces[k] if k in traces else microbatch_traced(traced, k, req.retracer)
        note = _levers_note(opts.zero, k, rc)
        pipe_failures += _floored(state, i, progress.cutoff(), note)
        beaten = _beaten(state, i, progress.cutoff())
        skip = {key for key, j in done.items() if j <= i} | {key for key, need in below.items() if k < need}
        try:
            got, failed, pipe_failed = _candidates(req.replace(traced=mb).with_options(recompute=rc),
                                                   pipelines=pipelines, microbatches=k, skip=skip, pipe_skip=pipe_fit,
                                                   pipelines_first=k == 1 and state_needs_pipeline(traced, mesh,
                                                                                                   opts, cap),
                                                   pipe_only=pipe_only, beaten=beaten)
        except PlanError as err:
            if k == 1 and pipeline_request and rc != choices[-1]:
                pipe_failures.append((f"pipeline ({note or 'no memory options'})", err))
                break           # a requested pipeline that does not fit: try more recomputation
            if k == 1:
                raise smallest_of(err, pipe_failures, mesh, cap, traced.batch_size) from None
            failures.append(Failure(mesh, note, err))    # e.g. a microbatch the mesh cannot split
            break
        plans += [accumulated(p, k, traced, mb) for p in got]
        state.fitting |= bool(got)
        _note_pipelines(state, got, pipe_failed, rc, k)
        _mark_done(done, got, failed, i, len(ks), state.floors)
        _note_below(below, failed, k, cap)
        failures += [Failure(m, note, e) for m, e in failed if not isinstance(e, DominatedError)]
        pipe_failures += pipe_failed + [(f"mesh {m.shape} ({note or 'no memory options'})", e)
                                        for m, e in failed if isinstance(e, DominatedError)]
        if pipelines and k == 1 and rc == choices[0] and not progress.fitting \
                and state_needs_pipeline(traced, mesh, opts, cap):
            got, pipe_failed = _pipelines_first(req.replace(traced=mb), choices[1:], set(keys), state)
            plans += got
            pipe_failures += pipe_failed
        i += 1
    return plans, failures, pipe_failures


def _note_below(below: dict, failed: list, k: int, cap: float) -> None:
    """``_frontier``'s ``below``: a mesh that cannot fit at ``k``, its least memory proven, is not tried at
    k' < k x least memory / cap (``_frontier``'s docstring)."""
    for m, e in failed:
        if not _stops_mesh(e) and isinstance(e, InfeasibleError) and getattr(e, "least_memory", None):
            below[(m.shape, m.axis_names)] = k * e.least_memory / cap


def _pipeline_choice(state: FrontierState, k: int, rc, opts: PlanOptions, pipeline_request: bool,
                     cutoff: float | None) -> tuple[bool, set | None]:
    """(whether ``_frontier`` tries pipelines at accumulation ``k`` and recompute choice ``rc``, the only
    pipeline candidates to try or None for all): at k = 1, ZeRO-0 or 1, a choice ``_pipelines_first`` did
    not run; at no recomputation, a fixed choice or a requested pipeline every candidate, with more
    recomputation every candidate while no plan fits, after that only the retries (``_retries``)."""
    again = _retries(state, cutoff) if k == 1 and state.fitting else set()
    pipelines = k == 1 and (opts.zero or 0) in PIPELINE_ZERO and not (isinstance(rc, str) and rc in state.early) and (
        rc == "none" or opts.recompute is not None or pipeline_request or not state.fitting or bool(again))
    only = again if pipelines and state.fitting and rc != "none" and opts.recompute is None \
        and not pipeline_request else None
    return pipelines, only


def _note_pipelines(state: FrontierState, got: list, pipe_failed: list, rc, k: int) -> None:
    """Records what the pipeline candidates gave at ``rc``: those that fit freely (``pipe_fit``: not tried
    again), the retries (``_note_retries``) and the (candidate, recompute choice) pairs tried (``pipes``)."""
    state.pipe_fit |= {(p.mesh.shape, p.mesh.axis_names) for p in got if p.pipeline is not None and not p.memory_bound}
    if k != 1:
        return
    _note_retries(state, got, pipe_failed)
    state.pipes |= {((p.mesh.shape, p.mesh.axis_names), str(rc)) for p in got if p.pipeline is not None}
    state.pipes |= {(e.full_key, str(rc)) for _, e in pipe_failed if getattr(e, "full_key", None)}


def _pipeline_tried(best: Plan, state: FrontierState | None) -> bool:
    """Whether ``best``'s pipeline candidate was tried at its recompute choice by the ZeRO stage whose
    frontier is ``state`` (``FrontierState.pipes``; False for a plan that is not a pipeline)."""
    if best.pipeline is None or state is None:
        return False
    return ((best.mesh.shape, best.mesh.axis_names), str(best.memory_options.recompute)) in state.pipes


def _note_retries(state: FrontierState, got: list, pipe_failed: list) -> None:
    """Records the pipelines to try again with more recomputation (``_retries``): those whose stage cut
    the cap shaped (``Plan.memory_bound``) and those refused for memory whose state fits (their error's
    ``free_step``), each with its step without the cap; one that fits freely leaves the list."""
    for p in got:
        if p.pipeline is None:
            continue
        key = (p.mesh.shape, p.mesh.axis_names)
        if p.memory_bound:
            state.retry[key] = p.pipeline.free_step
        else:
            state.retry.pop(key, None)
    for _, e in pipe_failed:
        key, free = getattr(e, "full_key", None), getattr(e, "free_step", None)
        if key is None:
            continue
        if free is None or isinstance(e, PipelineDominatedError):
            state.retry.pop(key, None)      # no room for its state, or slower than the best plan
        else:
            state.retry[key] = free


def _retries(state: FrontierState, cutoff: float | None) -> set:
    """The pipeline candidates (full mesh keys) worth another try with more recomputation once a plan of
    this ZeRO stage fits: the cap shaped or refused them at a lighter choice, and their step without
    the cap (``stage_cut.free_step``, by that choice's unit costs) beats the best plan so far.
    Recomputation only adds time and frees activations, so a pipeline with fewer stages (a smaller
    bubble, fewer hops) can then beat the deeper one that fitted without it. A heuristic filter (the
    estimate's layout was solved under the lighter choice's budget), not a bound."""
    if cutoff is None:
        return set(state.retry)
    return {key for key, free in state.retry.items() if free < cutoff}


def _mesh_keys(traced, mesh: Mesh, mode: ParallelMode, param_ann: dict, input_ann: dict) -> list[tuple]:
    """(shape, axis names) of every layout ``_candidates`` tries on ``mesh``: the factorisations (with
    the cp meshes ``traced`` allows), DDP's."""
    annotated = annotated_axes(param_ann, input_ann)
    meshes = candidate_meshes(mesh, annotated, traced) if mode == ParallelMode.AUTO else [mesh]
    keys = [(m.shape, m.axis_names) for m in meshes]
    if ddp_applies(mesh, mode, annotated):
        keys.append(((mesh.size,), ("dp",)))        # DDP's layout (``ddp_candidate``)
    return keys


def _levers_note(zero: int | None, k: int, rc) -> str:
    """The memory levers of a candidate, as its failures are labelled ("" for none)."""
    return ", ".join(([f"ZeRO-{zero}"] if zero else []) + ([f"accumulation {k}"] if k > 1 else [])
                     + ([f"recompute {rc}"] if rc != "none" else []))


def _stops_mesh(e: Exception) -> bool:
    """Whether a mesh's failure ends its frontier: its unbudgeted bound is dominated, or it cannot plan."""
    return isinstance(e, DominatedError) and e.unbudgeted or isinstance(e, PlanError)


def _floored(state: FrontierState, i: int, cutoff: float | None, note: str) -> list:
    """Marks done (from k index ``i``) every mesh whose floor proven at an index <= ``i`` (this recompute
    choice or an earlier one: ``state.floors``) reaches ``cutoff``, the best whole-step time so far;
    returns their (note, DominatedError) for the plan's alternatives. The floor is a solve's unbudgeted
    bound (``Plan.step_floor``): no layout of the mesh beats it at any budget, and the unbudgeted bound
    only grows with k and with recomputation (``_frontier``), so the mesh cannot win at index ``i`` or
    later, even where its last plan was shaped by the cap or it did not fit. A mesh whose floor is under
    the cutoff is still solved: a larger k may let a faster layout fit."""
    out = []
    for key, err in _beaten(state, i, cutoff).items():
        if state.done.get(key, math.inf) > i:
            state.done[key] = i
            out.append((f"mesh {key[0]} ({note or 'no memory options'})", err))
    return out


def _beaten(state: FrontierState, i: int, cutoff: float | None) -> dict:
    """Mesh key -> ``DominatedError`` for every mesh whose floor proven at an index <= ``i`` reaches
    ``cutoff`` (``_floored``'s test, done or not): the batch rule's outcome for a merged mesh that is not
    solved again (``_candidates``; a floor handed over from ZeRO-1, ``_share_floors``)."""
    if cutoff is None or not STEP_FLOORS:
        return {}
    out = {}
    for key, proven in state.floors.items():
        floor = max((f for j, f in proven if j <= i), default=-math.inf)
        if floor >= cutoff:
            out[key] = DominatedError(floor, cutoff, True)
    return out


def _mark_done(done: dict, got: list, failed: list, i: int, n: int, floors: dict | None = None) -> None:
    """``_frontier``'s ``done`` (mesh key -> from which k index on it is not tried) at k index ``i`` of
    ``n``: a mesh whose plan fits without the cap shaping it (nothing at this k with more recomputation
    or at a larger k beats it), one whose failure ends it (``_stops_mesh``), and a cp mesh the batch rule
    skipped at this k whose merged mesh is done (``cp_candidates.MergedAxisWins``: its optimum at any
    larger k or recomputation is at least its own at this k, at least the merged mesh's here, which
    is a plan already or reaches the cutoff). ``floors``: each solve's ``step_floor`` recorded at ``i``."""
    for p in got:
        if not p.memory_bound:
            key = (p.mesh.shape, p.mesh.axis_names)
            done[key] = min(done.get(key, n), i)
    for m, e in failed:
        if _stops_mesh(e) or isinstance(e, MergedAxisWins) and done.get(e.merged, n) <= i:
            done[(m.shape, m.axis_names)] = min(done.get((m.shape, m.axis_names), n), i)
    if floors is not None:          # each solve's floor at any budget (``_floored``)
        for m, floor in [(p.mesh, p.step_floor) for p in got if p.pipeline is None] + [
                (m, getattr(e, "step_floor", 0.0)) for m, e in failed]:
            if floor > 0:
                floors.setdefault((m.shape, m.axis_names), []).append((i, floor))


def _pipelines_first(req: SolveRequest, more_choices: list, skip: set, state: FrontierState) -> tuple[list, list]:
    """(plans, pipeline failures) of the recomputed pipelines ``_frontier`` tries right after k = 1, before
    the accumulation ladder, when nothing fits there and the state split over a node exceeds the cap
    (``state_needs_pipeline``): otherwise a time budget can end the search at a ladder plan that fits
    only by tensor parallelism across nodes. Each choice of ``more_choices`` until one fits, a pipeline
    only until it fits (``state.pipe_fit``: with more recomputation it could only pick a larger
    microbatch). ``req``: the step at k = 1."""
    plans, pipe_failures = [], []
    progress = req.opts.progress
    for more in more_choices:
        if progress.fitting or progress.out_of_time():
            break
        progress.enter(f"ZeRO-0, recompute {more}, accumulation 1: pipelines first")
        got, _, pipe_failed = _candidates(req.with_options(recompute=more), skip=skip, pipe_skip=state.pipe_fit)
        state.early.add(more)
        plans += got
        state.fitting |= bool(got)
        state.pipe_fit |= {(p.mesh.shape, p.mesh.axis_names) for p in got if not p.memory_bound}
        pipe_failures += pipe_failed
    return plans, pipe_failures


def replicated_state_bytes(traced, d: int, opts: PlanOptions) -> float:
    """The training state each device holds when every weight is whole (DDP's layout) over ``d``
    data-parallel devices, ZeRO sharding its stages' parts: a lower bound on that layout's memory
    that neither accumulation nor recomputation lowers."""
    params = parameter_nodes(traced.gm)
    dtype = params[0].meta["val"].dtype if params else None
    weights, grads, states = training_state_parts(param_numel(traced.gm), dtype, opts.optimizer, opts.precision)
    zero = opts.zero or 0
    return weights / (d if zero >= 3 else 1) + grads / (d if zero >= 2 else 1) + states / (d if zero >= 1 else 1)


def state_needs_pipeline(traced, mesh: Mesh, opts: PlanOptions, cap: float) -> bool:
    """Whether the training state, split over one node's devices (the widest tensor parallelism that
    stays on a node's links), exceeds the cap: then a layout without pipeline stages fits only by
    sharding the state over more devices than a node (tensor parallelism across nodes, ZeRO), and
    Megatron's published layouts from 39B parameters up pipeline with recomputation instead."""
    params = parameter_nodes(traced.gm)
    dtype = params[0].meta["val"].dtype if params else None
    state = training_state_bytes(param_numel(traced.gm), dtype, opts.optimizer, opts.precision)
    return state / min(mesh.size, mesh.gpus_per_node or mesh.size) > cap


def _candidates(req: SolveRequest, pipelines: bool = True, microbatches: int = 1, skip: set | None = None,
                pipe_skip: set | None = None, pipelines_first: bool = False, pipe_only: set | None = None,
                beaten: dict | None = None):
    """(plans, failures [(mesh, error)], pipeline failures [(note, error)]) of every candidate layout
    of one traced step, a microbatch of a step that accumulates ``microbatches``: each mesh
    factorisation, DDP's layout, then the pipeline candidates (only these when the request names a
    pipeline), whose estimates the best plan so far bounds; with ``pipelines_first`` (the state split
    over a node exceeds the cap: ``state_needs_pipeline``) the pipelines come first, their best
    bounding the meshes, which then fit only by tensor parallelism across nodes. Each is recorded in ``opts.progress`` (by
    its whole-step time); once the time budget is out no further mesh is solved. A mesh whose
    lower bound reaches the best whole-step time so far is not solved under the budget: its
    failure is a ``DominatedError`` (``solve_on_mesh``'s ``cutoff``). ``skip``: (shape, axis names)
    of meshes not to try (DDP's layout is the 1-D "dp" mesh); ``pipe_skip``: the same for pipeline
    candidates (their full meshes, pp first); ``pipe_only``: when given, the only pipeline candidates
    to try; ``beaten``: mesh key -> the ``DominatedError`` of a mesh whose floor reaches the best plan
    (``_floored``), for the batch rule when that mesh is not solved again."""
    beaten = beaten or {}
    traced, mesh, mode, opts = req.traced, req.mesh, req.mode, req.opts
    param_ann, input_ann = req.param_ann, req.input_ann
    skip = skip or set()
    progress = opts.progress or SearchProgress()
    step_time = lambda p: accumulated_time(p, microbatches)  # noqa: E731
    annotated = annotated_axes(param_ann, input_ann)
    pipeline_only = pipelines and pipeline_requested(traced, req.model, mesh, mode)
    meshes = [] if pipeline_only else candidate_meshes(mesh, annotated, traced) if mode == ParallelMode.AUTO else [mesh]
    plans, failures, pipe_failures, outcomes = [], [], [], {}     # outcomes: mesh key -> its plan or error
    first = pipelines and pipelines_first and not pipeline_only and not progress.out_of_time()
    if first:
        plans, pipe_failures, _ = pipeline_plans(req.with_options(progress=progress), pipe_skip, pipe_only)
    for m in meshes:
        if progress.out_of_time():
            break
        if (m.shape, m.axis_names) in skip:
            continue
        merged = None if annotated else batch_merged(traced, m)
        if merged is not None and _merged_wins(outcomes.get((merged.shape, merged.axis_names),
                                                            beaten.get((merged.shape, merged.axis_names)))):
            failures.append((m, MergedAxisWins(m, merged, traced.batch_size)))    # the batch rule: not solved
            continue
        try:
            plans.append(solve_on_mesh(req.replace(mesh=m, opts=_within_budget(opts, progress)),
                                       microbatches=microbatches, cutoff=progress.cutoff()))
            progress.record(plans[-1:], 0, step_time)
            outcomes[(m.shape, m.axis_names)] = plans[-1]
        except (InfeasibleError, DominatedError, SolverTimeoutError) as err:
            failures.append((m, err))
            progress.record([], 1, step_time)
            outcomes[(m.shape, m.axis_names)] = err
        except CandidateError as err:
            if mode != ParallelMode.AUTO:
                raise               # the user's own mesh: the error is theirs to fix
            failures.append((m, err))   # AUTO's candidate: dropped, its reason listed
            progress.record([], 1, step_time)
    ddp = ((mesh.size,), ("dp",))
    wasted = len([m for m in meshes if "cp" not in m.axis_names]) == 1 and bool(plans) and all(
        p.redundant_axes() for p in plans)      # (a cp candidate that splits something is no waste)
    if (ddp_applies(mesh, mode, annotated, wasted) and meshes and not progress.out_of_time()
            and ddp not in skip):       # DDP's layout keeps every weight whole: not where annotations split one
        got = ddp_candidate(traced, mesh, _within_budget(opts, progress), failures, microbatches, progress.cutoff())
        progress.record(got, 1 - len(got), step_time)
        plans += got
    if pipelines and not first and not progress.out_of_time():   # after the meshes: their best bounds the pipelines'
        pipe_plans, pipe_failures, _ = pipeline_plans(req.with_options(progress=progress), pipe_skip, pipe_only,
                                                      flat_steps(outcomes, step_time))
        plans = list(pipe_plans) + plans
    return plans, failures, pipe_failures


def _merged_wins(outcome) -> bool:
    """Whether a cp mesh's merged mesh (``cp_candidates.batch_merged``), solved just before it on the
    same microbatch, leaves it nothing to win: a plan that wastes no axis (the cp mesh's step is no
    faster, and ``rank_key`` would rank it no better), or a proof that it cannot fit or beat the best
    plan (the cp mesh holds the same tokens per rank and its K/V buffers besides). A plan that wastes
    an axis, a timeout or no solve at this size (``None``): the cp mesh is solved."""
    if isinstance(outcome, Plan):
        return not outcome.redundant_axes()
    return isinstance(outcome, (InfeasibleError, DominatedError))


def _within_budget(opts: PlanOptions, progress: SearchProgress) -> PlanOptions:
    """``opts`` with the solver's time limit cut to what is left of the search's time budget
    (``SearchProgress.time_limit``)."""
    return dataclasses.replace(opts, time_limit_s=progress.time_limit(opts.time_limit_s))


def rank_key(plan: Plan) -> tuple[bool, float]:
    """What AUTO minimises: first whether a mesh axis repeats the work (a plan that splits nothing on
    an axis wastes its devices, however fast its step), then the predicted step time (forward,
    backward, gradient sync and optimizer)."""
    return bool(plan.redundant_axes()), plan.step_time


def ddp_applies(mesh: Mesh, mode: ParallelMode, annotated: frozenset, wasted: bool = False) -> bool:
    """Whether AUTO also tries DDP's layout: on an unnamed mesh without annotations that has several
    factorisations, or a prime number of devices where the free 1-D mesh, the only other candidate,
    gave only plans that split nothing (``wasted``: a CNN and a ViT on 2 devices)."""
    if mode != ParallelMode.AUTO or mesh.named or annotated or mesh.size == 1:
        return False
    return len(candidate_meshes(mesh)) > 1 or wasted


def ddp_candidate(traced, mesh: Mesh, opts: PlanOptions, failures: list, microbatches: int = 1,
                  cutoff: float | None = None) -> list[Plan]:
    """DDP's layout as one of AUTO's candidates: the DATA-mode plan on the whole mesh (every weight
    whole, the batch split), which AUTO's own solve on a ``dp`` axis may not reproduce."""
    m = mesh.reshape((mesh.size,), ("dp",))
    state, cap = replicated_state_bytes(traced, mesh.size, opts), _cap(mesh, opts)
    if state > cap:
        failures.append((m, CandidateError(
            f"DDP's layout keeps the training state whole on every device ({state / 2**30:.2f} GiB of weights, "
            f"gradients and optimizer state under ZeRO-{opts.zero or 0}) over the {cap / 2**30:.2f} GiB cap, "
            "at any accumulation or recomputation")))
        return []
    try:
        plan = solve_on_mesh(SolveRequest(traced, None, m, ParallelMode.DATA, opts), microbatches=microbatches,
                             cutoff=cutoff)
    except (InfeasibleError, PlanError, DominatedError, SolverTimeoutError) as err:
        failures.append((m, err))
        return []
    plan.mode = ParallelMode.AUTO
    plan.candidate = "DDP layout"
    return [plan]


__all__ = ["make_plans", "ddp_candidate", "PlanOptions", "solve_on_mesh", "PlanError", "candidate_meshes", "R"]
