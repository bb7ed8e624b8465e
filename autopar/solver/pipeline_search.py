"""Pipeline (inter-layer) plans: pipeline degree, stage cuts, microbatches and schedule.

Representation: the plan's mesh gets a leading ``pp`` axis, ``Mesh((pp, *sub.shape), ("pp", *sub.names))``;
every spec is ``R`` on ``pp``; all stages share one intra-op plan solved on the ``(dp, tp)``
sub-mesh for the graph traced at the MICRObatch shape (global batch / m; shapes are static).

For one candidate ``(pp, sub-mesh)`` (``plan_pipeline``):
    0. (AUTO, ``pipeline_plans``) a candidate that cannot fit by lower bounds on its units' state and
       activations (``pipeline_fit.fit_refusal``) is refused without a solve.
    1. trace at microbatch size ``b_ref`` and solve the intra-op problem on the sub-mesh with the
       memory bound ``pp * budget`` (the whole model is spread over pp stages; the exact per-stage
       bound, with in-flight activations, is enforced in 3).
    2. per unit ``u`` (``autopar.graph.cut_points``) a ``LayerProfile`` (``unit_costs.unit_profiles``:
       time, state, saved activations, bytes crossing the cut, what its parameters add once per
       step and, with m > 1, the data-parallel gradients' second copy held after the schedule).
    3. for each schedule and microbatch count ``m`` (``m | B``, ``(B / m) % dp == 0``; interleaved: and
       each v of ``virtual_stages.virtual_stage_choices``), the profile
       at size ``b = B / m`` is ``launch + (time - launch) * b / b_ref`` (kernel launches do not
       shrink with the batch), and ``inter_op.partition_stages`` cuts the units into stages
       (DP over cut points, memory incl. the schedule's in-flight activations).
           step(m, schedule) = simulate(schedule).critical_path + max_r sum_{u on rank r} (sync_u + opt_u)
       (the optimizer step included, as in any plan; the fullest rank's is ``plan.optimizer_time``).
       The best (m, schedule) (ties: less memory) is re-solved at its own microbatch shape and
       re-partitioned with the exact profile, unless its reference estimate is over (1 +
       ``REFERENCE_MARGIN``) x the search's best plan so far (dropped: a heuristic, docs/solver.md).
       Every sub-mesh solve gets the cutoff pp x that (``whole_step_cutoff``, on the whole step of m
       microbatches): a layout proven or found at least that slow drops the candidate unpartitioned.

``pipeline_plans`` enumerates the candidates for a request: a named mesh with a ``pp`` axis
fixes pp and the sub-mesh; ``pipeline_stage`` tags fix pp = max tag + 1 and the cuts they name;
AUTO on an unnamed mesh tries every pp >= 2 dividing the devices (at most the number of layers)
times every (dp, tp) factorisation of the rest, tp inside a node when ``gpus_per_node`` is set, and,
for a model with attention whose rows run out, one (dp, cp, tp) per tp (``_cp_sub_meshes``).
"""
from __future__ import annotations

import math
from dataclasses import replace

from autopar.core.context import ParallelMode
from autopar.cost_models.compute import total_flops
from autopar.cost_models.param_step import optimizer_step_time
from autopar.cost_models.devices import axis_link
from autopar.cost_models.zero import zero_axes
from autopar.graph.buffer_writes import updates_buffers
from autopar.graph.cut_points import assign_units, end_cuts, unit_of_module
from autopar.graph.retrace import Retracer, graph_fingerprint, microbatch_trace
from autopar.core.mesh import Mesh
from autopar.plan.plan import PipelineInfo, Plan, PlanError, Stage
from autopar.schedules.receive_window import schedule_receive_buffers
from autopar.sharding.placements import R, Spec, shard_factor
from autopar.solver.inter_op import CutRules, PipelinePartition, StageMemoryError, partition_stages
from autopar.solver.accumulation import accumulated_time
from autopar.solver.candidate_order import by_flat_steps
from autopar.solver.pipeline_candidates import PipelineCandidate, pipeline_candidates
from autopar.solver.fit_error import pipeline_nothing_fits, stage_fit_error
from autopar.solver.intra_op import DominatedError, InfeasibleError, SolverTimeoutError
from autopar.solver.pipeline_fit import (PipelineDominatedError, PipelineRequestError, budget_bytes, fit_refusal, held, holds_more,
                                         microbatch_counts, model_parallel_first, schedules)
from autopar.solver.pipeline_bound import bounds_enabled, by_floor, candidate_floors, floor_dominated
from autopar.solver.pipeline_steer import _next_share, _tighter, in_flight_weight, between_shares
from autopar.solver.mesh_solve import PlanOptions, solve_on_mesh
from autopar.solver.pipeline_collectives import pipeline_collectives
from autopar.solver.stage_tags import check_stage_tags
from autopar.solver.end_units import stage_layer_names
from autopar.solver.unit_costs import UnitCosts, launch_seconds, unit_profiles
from autopar.solver.stage_cut import free_estimate, free_step, partition_at as _partition
from autopar.solver.request import SolveRequest
from autopar.cost_models.devices import mesh_device

BUFFER_UPDATES = ("the model updates buffers in forward (e.g. BatchNorm running statistics): a pipeline runs it as "
                  "one microbatch, since microbatches would be normalised with their own statistics")


def pipeline_blocker(traced) -> str | None:
    """Why this graph cannot be pipelined (None when it can)."""
    if traced.buffer_mutations:
        return ("the model updates buffers in forward (e.g. BatchNorm running statistics); microbatches would "
                "change them, so pipelining would not train like the single-device model")
    if not traced.has_loss:
        return "pipeline training needs the loss in the traced step (pass loss_fn= and example_target=)"
    return None


# ---- one candidate ---------------------------------------------------------------------

def _fixed_boundaries(cand: PipelineCandidate, units, gm) -> list[int]:
    cuts = []
    for module, k in cand.fixed.items():
        u = unit_of_module(units, gm, module)
        if u is None:
            raise PipelineRequestError(
                f"pipeline_stage({module!r}, {k}): module {module!r} runs no op in the traced model (it is not "
                f"called in forward, or the name is wrong); tag one of the layers {[x.name for x in units][:6]}")
        if k > 0:
            cuts.append(u)
    return sorted(set(cuts))


def _check_tags(part: PipelinePartition, cand: PipelineCandidate, units, gm) -> None:
    for module, k in cand.fixed.items():
        u = unit_of_module(units, gm, module)
        stage = next(i for i, s in enumerate(part.stages) if s.layers[0] <= u < s.layers[1])
        if stage != k:
            raise PipelineRequestError(f"pipeline_stage({module!r}, {k}): the other tags leave {module!r} on stage "
                                       f"{stage}; tag the first layer of every stage")


def plan_pipeline(traced, cand: PipelineCandidate, mode: ParallelMode, opts, param_ann: dict, input_ann: dict,
                  retracer: Retracer | None = None) -> Plan:
    """The best pipeline plan for one (pp, sub-mesh) candidate (module docstring)."""
    return _CandidateSearch(traced, cand, mode, opts, param_ann, input_ann, retracer).run()


class _CandidateSearch:
    """``plan_pipeline`` for one candidate: solve the reference microbatch count, tighten the
    whole-model budget while no cut fits (``pipeline_steer``), rank every (schedule, m) by the
    reference's costs, then re-solve the best counts at their own shapes until one fits."""

    def __init__(self, traced, cand: PipelineCandidate, mode: ParallelMode, opts, param_ann: dict, input_ann: dict,
                 retracer: Retracer | None):
        self.traced, self.cand, self.mode, self.opts = traced, cand, mode, opts
        self.param_ann, self.input_ann, self.retracer = param_ann, input_ann, retracer
        self.batch = batch = traced.batch_size
        dp = cand.sub.shape[cand.sub.axis_names.index("dp")] if "dp" in cand.sub.axis_names else 1
        self.counts = microbatch_counts(batch, dp, opts)
        units, _ = assign_units(traced.gm)
        if cand.pp > len(units):
            raise PipelineRequestError(
                f"cannot split the model into {cand.pp} pipeline stages: the traced model has {len(units)} layer(s) "
                f"({', '.join(u.name for u in units[:8])}) and every stage needs at least one; use at most "
                f"{len(units)} stages")
        ends = assign_units(traced.gm, ends=True)[0]     # the embedding and head as units (``end_units``)
        self.kinds = schedules(opts, cand.pp, len(ends), len(units))
        self.per_node = min(cand.full.size, cand.full.gpus_per_node or cand.full.size)
        # CPU ranks of every stage share the cores; a compiled program's ops run at the compiled speedup
        self.device = mesh_device(cand.sub).shared_by(self.per_node).with_compile(opts.compiled)
        self.budget = budget_bytes(cand, opts)
        self.loose = PlanOptions(**{**opts.__dict__, "memory_budget_gb": 1e6})
        link_spec = axis_link(self.device, cand.pp, cand.sub.size)
        self.link = (link_spec.bandwidth, link_spec.latency)
        self.share = 1.0          # of pp x the cap the whole model's layout is solved under (``_tighter``)
        self.unbounded = False    # the last layout fitted no such budget (solved without one): tighter cannot help
        self.fitted = None        # the share of the last budget a layout fitted (``between_shares``)
        self.rules = CutRules(allow_idle=cand.allow_idle,   # the tags' cut points once the reference is traced
                              virtual_stages=opts.virtual_stages, joined=end_cuts(ends))

    def _request(self, mb, opts: PlanOptions) -> SolveRequest:
        """The sub-mesh solve of traced microbatch ``mb`` under ``opts``."""
        return SolveRequest(mb, None, self.cand.sub, self.mode, opts, self.param_ann, self.input_ann)

    def solve(self, m: int, reference: bool = False):
        """The sub-mesh plan at m microbatches: (traced microbatch, plan, units, unit_of, unit costs).
        Raises ``PipelineDominatedError`` where the layout's whole step reaches ``whole_step_cutoff``
        (found, or proven by the solve's ``DominatedError``); for the ``reference`` layout, whose costs
        estimate every count, with room for the counts' fewer kernel launches."""
        cand, opts, batch = self.cand, self.opts, self.batch
        mb = microbatch_trace(self.traced, batch // m, self.retracer)
        self.unbounded = False
        weight = in_flight_weight(self.kinds, cand.pp, self.counts, batch, batch // m)
        shares, sub_plan, first = [self.share], None, True
        best = opts.progress.cutoff() if opts.progress is not None else None
        fewer = (m - min(self.counts)) * launch_seconds(mb, self.device) if reference else 0.0
        cutoff = whole_step_cutoff(best, cand.pp, fewer)
        try:
            while shares and sub_plan is None:
                s = shares.pop(0)
                whole = PlanOptions(**{**opts.__dict__, "memory_budget_gb": s * self.budget * cand.pp / 2**30})
                try:
                    sub_plan = solve_on_mesh(self._request(mb, whole), microbatches=m, cutoff=cutoff,
                                             activation_weight=weight, ranks_per_node=self.per_node,
                                             explain=first and self.fitted is not None)
                    self.share = self.fitted = s
                except InfeasibleError as err:      # between it and the last budget that fitted, if any
                    if first:
                        shares = between_shares(s, self.fitted, getattr(err, "least_memory", None),
                                                self.budget * cand.pp)
                first = False
            if sub_plan is None:        # pp x the cap only guides the whole model's layout:
                self.unbounded = True
                sub_plan = solve_on_mesh(self._request(mb, self.loose), microbatches=m, cutoff=cutoff,
                                         ranks_per_node=self.per_node)    # the partition enforces it
        except DominatedError as err:
            raise _beaten(best, m, cand.pp, err.lower_bound * m) from None
        if cutoff is not None and (whole_step := accumulated_time(sub_plan, m)) >= cutoff:
            raise _beaten(best, m, cand.pp, whole_step)
        units_m, unit_of = assign_units(mb.gm, ends=True)
        return mb, sub_plan, units_m, unit_of, unit_profiles(mb, sub_plan, units_m, unit_of, self.device, opts)

    def rank(self, costs, ref_plan, ref: int):
        """(key, m, schedule) of each partition that fits by the reference costs; why the others failed.
        The count holding the fewest activations in flight is cut first; once it fits no cut for
        memory, a count m > 1 holding at least as many on every stage (``held``) in no more room is
        refused without its DP: its stages hold at least as much at every cut (the state and the
        gradients' second copy are the same, activations scale as 1 / m)."""
        cand, batch, budget = self.cand, self.batch, self.budget
        ranked, reasons, errors = [], [], []
        for schedule in self.kinds:
            ms = [m for m in self.counts if schedule != "interleaved_1f1b" or m % cand.pp == 0]
            room = {m: budget - _extra_at(ref_plan, ref, m) - _buffers(costs, batch // m, m, schedule, cand.pp)
                    for m in ms}
            tried: dict = {}
            for m in sorted(ms, key=lambda m: (sum(held(schedule, cand.pp, m)), -m)):
                over = next((o for o, r in tried.items() if isinstance(r, StageMemoryError) and m > 1 and o > 1
                             and room[m] <= room[o] and holds_more(schedule, cand.pp, m, o)), None)
                if over is not None:
                    tried[m] = ValueError(f"holds at least m={over}'s activations in flight on every stage, in no more "
                                          f"room, and m={over} fits no cut")
                    continue
                try:
                    part, t, _ = _partition(costs, batch // m, cand.pp, m, schedule, room[m], self.link, self.rules)
                    tried[m] = ((round(t, 12), max(part.rank_memory)), m, schedule)
                except ValueError as err:
                    tried[m] = err
            for m in ms:
                if isinstance(tried[m], Exception):
                    reasons.append((_closeness(tried[m], room[m]), f"{schedule} m={m}: {tried[m]}"))
                    errors.append(tried[m])
                else:
                    ranked.append(tried[m])
        return ranked, [r for _, r in sorted(reasons, key=lambda r: r[0])], errors

    def run(self) -> Plan:
        cand, opts, budget = self.cand, self.opts, self.budget
        ref = reference_count(self.counts, cand.pp)
        solved = {ref: self.solve(ref, reference=True)}
        mb, ref_plan, units_ref, _, costs = solved[ref]
        self.rules = CutRules(tuple(_fixed_boundaries(cand, units_ref, mb.gm)), cand.allow_idle, opts.virtual_stages,
                              end_cuts(units_ref))
        ranked, reasons, errors = self.rank(costs, ref_plan, ref)
        for _ in range(TIGHTER):
            if ranked or self.unbounded or (tighter := _tighter(errors, budget - _extra(ref_plan))) is None:
                break
            self.share = _next_share(self.share, tighter, max(ref_plan.memory_per_device), budget * cand.pp)
            solved = {ref: self.solve(ref, reference=True)}
            mb, ref_plan, units_ref, _, costs = solved[ref]
            ranked, reasons, errors = self.rank(costs, ref_plan, ref)
        cutoff = opts.progress.cutoff() if opts.progress is not None else None
        if ranked and cutoff is not None and min(r[0][0] for r in ranked) >= (1 + REFERENCE_MARGIN) * cutoff:
            raise PipelineDominatedError(
                f"slower than the best plan so far ({cutoff:.4g} s): its best stage cut by the reference microbatch's "
                f"costs takes {min(r[0][0] for r in ranked):.4g} s (over {1 + REFERENCE_MARGIN:g}x; not solved at "
                "other microbatch sizes)")
        if not ranked:
            msg = "no pipeline partition fits: " + "; ".join(reasons[:3])
            err = stage_fit_error(msg, errors, ref_plan.memory_breakdown, cand.full, budget, opts) or \
                PipelineRequestError(msg)
            states = [e.state for e in errors if isinstance(e, StageMemoryError)]
            if states and min(states) < budget - _extra(ref_plan):     # the state fits: less activation might
                err.free_step = free_estimate(costs, self.batch, cand.pp, self.counts, self.kinds, self.link,
                                               self.rules) + ref_plan.grad_sync_overhead
            raise err
        ranked.sort(key=lambda r: r[0])
        return self.finish(ranked, solved, errors)

    def finish(self, ranked: list, solved: dict, errors: list) -> Plan:
        """Re-solve the ranked counts at their own shapes, best first, until one partitions. A count whose
        layout is proven over the margin (``solve``'s ``PipelineDominatedError``) drops the candidate, as
        its partition's step over the margin would have (the counts after it estimate slower)."""
        cand, opts, batch, budget = self.cand, self.opts, self.batch, self.budget
        found, failed, timeouts, timeouts_at = None, [], [], set()
        for _, m, schedule in ranked:
            # out of time: only the microbatch counts already solved, no other solve
            if m not in solved and opts.progress is not None and opts.progress.out_of_time() and \
                    any(r[1] in solved for r in ranked):
                continue
            if m in timeouts_at:
                continue
            if m not in solved:
                if len(solved) >= 3:
                    break               # the reference costs misjudge this candidate: give up after two more solves
                try:
                    solved[m] = self.solve(m)
                except SolverTimeoutError as err:   # the counts already solved may still give a plan
                    failed.append(f"{schedule} m={m}: {err}")
                    timeouts.append(err)
                    timeouts_at.add(m)
                    continue
            mb, sub_plan, units_m, unit_of, costs_m = solved[m]
            try:        # the partition at m's own costs (a partition that fit by the reference's may not)
                part, step, opt = _partition(costs_m, batch // m, cand.pp, m, schedule,
                                             budget - _extra(sub_plan) - _buffers(costs_m, batch // m, m, schedule,
                                                                                  cand.pp), self.link,
                                             self.rules)
            except ValueError as err:
                failed.append(f"{schedule} m={m}: {err}")
                errors.append(err)
                continue
            found = m
            break
        if found is None:
            if timeouts and len(timeouts) == len(failed):
                raise timeouts[0]       # no count was refused for memory: the time limit is what to raise
            msg = "no pipeline partition fits at the microbatch counts solved: " + "; ".join(failed[:3])
            raise stage_fit_error(msg, errors, sub_plan.memory_breakdown, cand.full, budget, opts) or \
                PipelineRequestError(msg)
        _check_tags(part, cand, units_m, mb.gm)
        free = free_step(costs_m, batch // m, cand.pp, m, part.schedule, self.link,
                          replace(self.rules, virtual_stages=part.virtual_stages if part.virtual_stages > 1 else None))
        step += sub_plan.grad_sync_overhead
        plan = _assemble(self.traced, mb, sub_plan, cand, part, step, units_m, budget)
        plan.memory_bound = free < (step - sub_plan.grad_sync_overhead) * (1 - 1e-9)   # the cap shaped the cut
        plan.pipeline.free_step = min(free + sub_plan.grad_sync_overhead, step)
        plan.collective_list = pipeline_collectives(mb.gm, plan, self.link)
        _stage_memory(plan, part, costs_m, sub_plan, _buffers(costs_m, batch // m, m, part.schedule, cand.pp))
        plan.optimizer_time = opt
        return plan


def reference_count(counts: list[int], pp: int) -> int:
    """The microbatch count a candidate is solved at first, whose costs rank every (schedule, m)
    (``_CandidateSearch.rank``) and drop a candidate whose best estimate is over ``REFERENCE_MARGIN`` x
    the best plan: the most microbatches up to 2 pp (else the fewest). Each count's estimate scales the
    reference's work, less its launches, by the rows: a count of more, smaller microbatches than the
    reference is estimated at the reference's better matmul efficiency, so the estimates err low there
    and the drop stays cautious. The most microbatches as the reference would make every other count's
    microbatch larger and its estimate high, so the drop could lose the best count (docs/solver.md)."""
    return max([m for m in counts if m <= 2 * pp] or [min(counts)])


def whole_step_cutoff(best: float | None, pp: int, launches: float = 0.0) -> float | None:
    """The cutoff of a candidate's sub-mesh solves (``solve_on_mesh``'s, on the whole-model step T of m
    microbatches): pp x (1 + ``REFERENCE_MARGIN``) x the best plan so far, plus ``launches``.

    Any partition of a layout into pp ranks runs at least T / pp: the critical path is at least the
    busiest rank's work, at least its average m·every / pp, and the fullest rank's once-per-step part
    at least once / pp. So a layout solved at m itself (``finish``) at least pp x (1 + margin) x best
    gives a plan over the margin at m. The reference layout's costs estimate every count m' by scaling
    its units' work less their kernel launches (``UnitCosts.at``), so m''s whole step is at least
    T - (m - m') x L, L the launches of one microbatch: with ``launches`` = (m - least m') x
    ``unit_costs.launch_seconds`` every count estimates over the margin, and ``rank`` would drop the
    candidate. Either way it is dropped before the budgeted solve ends. None without a plan so far."""
    if best is None or not math.isfinite(best):
        return None
    return pp * (1 + REFERENCE_MARGIN) * best + launches


def _beaten(best: float, m: int, pp: int, whole: float) -> PipelineDominatedError:
    """Why a candidate is dropped whose layout at m microbatches takes at least ``whole`` seconds a step
    on its sub-mesh (``whole_step_cutoff``)."""
    return PipelineDominatedError(
        f"slower than the best plan so far ({best:.4g} s): its whole-model layout at {m} microbatches takes at least "
        f"{whole:.4g} s a step on the sub-mesh, so at least {whole / pp:.4g} s over {pp} stages (over "
        f"{1 + REFERENCE_MARGIN:g}x; not partitioned)")


def _extra_at(ref_plan: Plan, ref: int, m: int) -> float:
    """``_extra`` of the reference solve (``ref`` microbatches) as a lower bound for ``m``: with fewer
    rows per microbatch (m > ref) the backward workspace is at least ref / m of the reference's (its
    activation-sized part scales with the rows, its parameter gradients do not shrink), so a count
    is ranked in at least the room it has; its own solve then checks the partition exactly (the
    reference's whole workspace, charged at every count, overstates a count of smaller microbatches
    by the loss's logits at the reference's rows)."""
    sub = ref_plan.memory_breakdown or {}
    return sub.get("transient", 0.0) * min(1.0, ref / m) + sub.get("inputs", 0.0)


def _closeness(err: Exception, room: float) -> float:
    """How far a refused count is from fitting (its least peak over its room; a refusal that is not for
    memory last): the failure note lists the counts that came closest first."""
    if isinstance(err, StageMemoryError) and room > 0:
        return (err.state + err.activations) / room
    return math.inf


REFERENCE_MARGIN = 0.1  # a candidate whose reference-cost estimate is this much over the best plan is dropped
TIGHTER = 2     # re-solves of the whole model's layout under a tighter budget when no stage cut fits


def _extra(sub_plan: Plan) -> float:
    """Bytes a stage holds beyond its partition's state and in-flight activations: the sub-plan's
    backward transients and the step's inputs (``_stage_memory``). Not its gathered parameter copies:
    each unit's are in its activations (``unit_costs.KeptCopies``), so adding the whole model's would
    count them pp times. Not its "accumulated gradients": the whole model's, of which each stage's own
    share is in its units' state (``UnitCosts.at``)."""
    sub = sub_plan.memory_breakdown or {}
    return sub.get("transient", 0.0) + sub.get("inputs", 0.0)


def _buffers(costs: UnitCosts, batch: int, m: int, schedule: str, pp: int) -> float:
    """Bytes of a rank's receive buffers: the runtime keeps a window of posted receives per sender
    (``receive_window``), at most ``schedule_receive_buffers`` at once, each at most the largest
    unit's output (not 2 m of them: the runtime does not post every receive of the step up front)."""
    largest = max((x.out_bytes for x in costs.at(batch)), default=0.0)
    v = 2 if schedule == "interleaved_1f1b" else 1
    return largest * schedule_receive_buffers(schedule, pp, m, v)


def _stage_memory(plan: Plan, part: PipelinePartition, costs: UnitCosts, sub_plan: Plan, buffers: float = 0.0) -> None:
    """Per rank: the partition's state + in-flight saved activations (with each unit's gathered
    parameter copies), plus the sub-plan's backward workspace ('transient': its largest op, the loss
    for a language model, so an overestimate for stages without it). ``memory_breakdown`` is the
    fullest rank's."""
    sub = sub_plan.memory_breakdown or {}
    extra = _extra(sub_plan) + buffers
    plan.memory_per_device = [m + extra for m in plan.memory_per_device]
    fullest = max(range(len(part.rank_memory)), key=lambda r: part.rank_memory[r])
    state = sum(sum(p.param_bytes for p in costs.profiles[a:b])
                for (a, b), r in ((st.layers, st.rank) for st in part.stages) if r == fullest)
    plan.memory_breakdown = {"params+grads+optimizer": state, "activations": part.rank_memory[fullest] - state}
    for key in ("transient", "inputs"):
        if key in sub:
            plan.memory_breakdown[key] = sub[key]
    if buffers:
        plan.memory_breakdown["pipeline buffers"] = buffers


def _with_pp(spec):
    """The sub-mesh's spec on the full mesh: replicated over the pipeline axis (axis 0) in front."""
    if isinstance(spec, list):
        return [_with_pp(s) for s in spec]
    return Spec((R,) + tuple(spec)) if spec else spec


def _assemble(traced, mb, sub_plan: Plan, cand: PipelineCandidate, part: PipelinePartition, step: float, units,
              budget) -> Plan:
    """The pipeline plan of the candidate: ``sub_plan`` (solved in the request's mode) on the full mesh."""
    full, pp = cand.full, cand.pp
    per_pp = full.size // pp
    for d in sub_plan.nodes.values():
        d.inputs, d.output = [_with_pp(s) for s in d.inputs], _with_pp(d.output)
        d.local = [None] + list(d.local)        # per-axis lists gain the (replicated) pp axis too
    for d in sub_plan.params.values():
        d.spec = _with_pp(d.spec)
    stages = []
    for s, sp in enumerate(part.stages):
        nodes = [n for u in units[sp.layers[0]:sp.layers[1]] for n in u.nodes]
        ranks = list(range(sp.rank * per_pp, (sp.rank + 1) * per_pp))
        stages.append(Stage(s, nodes, stage_layer_names(units[sp.layers[0]:sp.layers[1]]), ranks,
                            sp.fwd + sp.bwd, sp.memory, sp.fwd, sp.bwd, sp.send_time))
    memory = [part.rank_memory[r // per_pp] for r in range(full.size)]
    info = PipelineInfo(microbatch_size=mb.batch_size, microbatch_fingerprint=graph_fingerprint(mb.gm),
                        virtual_stages=part.virtual_stages, bubble_fraction=part.bubble_fraction,
                        pipeline_time=part.step_time, sub_mesh=list(cand.sub.shape))
    return Plan(mode=sub_plan.mode, mesh=full, degrees={**sub_plan.degrees, "pp": pp},
                axis_roles={full.axis_names[0]: "pp", **sub_plan.axis_roles}, nodes=sub_plan.nodes,
                params=sub_plan.params, inputs={k: _with_pp(v) for k, v in sub_plan.inputs.items()},
                outputs={k: _with_pp(v) for k, v in sub_plan.outputs.items()}, microbatches=part.microbatches,
                schedule=part.schedule, stages=stages, step_time=step, flops=total_flops(traced.gm),
                memory_per_device=memory, solver_status=sub_plan.solver_status, unknown_ops=sub_plan.unknown_ops,
                options=dict(sub_plan.options), fingerprint=graph_fingerprint(traced.gm),
                collective_list=sub_plan.collective_list, pipeline=info, grad_compression=sub_plan.grad_compression,
                compiled=sub_plan.compiled,
                optimizer=sub_plan.optimizer, memory_budget=budget, grad_sync_overhead=sub_plan.grad_sync_overhead,
                memory_options=sub_plan.memory_options,
                axis_shares=sub_plan.axis_shares)


# ---- the search entry -------------------------------------------------------------------

def optimizer_time(plan: Plan, optimizer: str = "adamw") -> float:
    """Seconds of one optimizer step over the parameters one rank holds (the fullest stage)."""
    if plan.optimizer_time is not None:
        return plan.optimizer_time
    mesh = plan.mesh
    params = [d for d in plan.params.values() if d.kind == "parameter"]
    numel = sum(math.prod(d.shape) / shard_factor(d.spec, mesh.shape) / _zero_shards(plan, d.spec) for d in params)
    device = mesh_device(mesh).shared_by(min(mesh.size, mesh.gpus_per_node or mesh.size))
    return optimizer_step_time(numel, device, len(params), optimizer)


def _zero_shards(plan: Plan, spec) -> int:
    """How many ranks split a parameter's optimizer step under ZeRO: its replicated axes."""
    if not plan.memory_options.zero:
        return 1
    return zero_axes(spec, plan.mesh.shape)[1]


def pipeline_requested(traced, model, mesh: Mesh, mode: ParallelMode) -> bool:
    """Whether the request names a pipeline (a pp axis, stage tags): then only pipelines are planned.
    A request ``pipeline_plans`` would refuse counts as one, so that its error is the one raised."""
    from autopar.solver.annotations import ANNOTATIONS, resolve_stages

    tags = resolve_stages(model, ANNOTATIONS) if mode in (ParallelMode.AUTO, ParallelMode.SEMI_AUTO) else {}
    try:
        return pipeline_candidates(traced, mesh, mode, tags)[1]
    except PipelineRequestError:
        return True


def _refusals(traced, opts):
    """``refusal(cand)``: ``fit_refusal``, or the request's own error for that candidate (a dp that splits
    no microbatch), computed once per candidate."""
    memo: dict = {}

    def refusal(c):
        if id(c) not in memo:
            try:
                memo[id(c)] = fit_refusal(traced, c, opts)
            except PipelineRequestError as err:
                memo[id(c)] = err
        return memo[id(c)]
    return refusal


def pipeline_plans(req: SolveRequest, skip: set | None = None, only: set | None = None, flat: dict | None = None):
    """(plans, failures [(note, error)], forced) for every pipeline candidate of the request; its
    ``retracer`` re-traces the step at a microbatch shape. ``skip``: (shape, axis names) of the full
    meshes of candidates not to try; ``only``: when given, the only ones to try; ``flat``: tp -> the
    step of the flat meshes solved (``candidate_order.flat_steps``), the order AUTO tries them in. A
    failure's error carries its candidate's full mesh key as ``full_key``."""
    from autopar.solver.annotations import ANNOTATIONS, resolve_stages

    traced, model, mesh, mode, opts = req.traced, req.model, req.mesh, req.mode, req.opts

    tags = resolve_stages(model, ANNOTATIONS) if mode in (ParallelMode.AUTO, ParallelMode.SEMI_AUTO) else {}
    try:
        cands, forced = pipeline_candidates(traced, mesh, mode, tags)
    except PipelineRequestError as err:
        raise PlanError(str(err)) from None
    if not cands:
        return [], [], forced
    if tags:
        check_stage_tags(tags, assign_units(traced.gm)[0], traced.gm, cands[0].pp)
    blocker = pipeline_blocker(traced)
    if blocker:
        if forced:
            raise PlanError(f"cannot pipeline this model: {blocker}")
        return [], [("pp", blocker)], False
    if updates_buffers(traced):      # BatchNorm's statistics must stay the whole batch's
        if not forced:               # one microbatch only: a pipeline would not pay
            return [], [("pp", BUFFER_UPDATES)], False
        if opts.microbatches not in (None, 1):
            raise PlanError(f"microbatches={opts.microbatches}: the model updates buffers in forward (e.g. BatchNorm "
                            "running statistics), so each microbatch would be normalised with its own statistics and "
                            "not train like the single-device model; use microbatches=1 (or leave it unset)")
        opts = replace(opts, microbatches=1)
    num_units, batch = len(assign_units(traced.gm)[0]), traced.batch_size
    if not forced:
        cands = model_parallel_first(traced, by_flat_steps(cands, flat), opts)
    plans, failures = [], []
    progress = opts.progress
    refusal = _refusals(traced, opts)
    floors = {} if forced or not bounds_enabled() or (progress is not None and progress.out_of_time()) else \
        candidate_floors(traced, cands, mode, opts, req.param_ann, req.input_ann,
                         lambda c: c.pp <= num_units and not (skip and (c.full.shape, c.full.axis_names) in skip)
                         and refusal(c) is None)
    if floors:
        cands = by_floor(traced, cands, floors, opts)    # the likeliest best first: its plan bounds the rest
    for cand in cands:
        if progress is not None and progress.out_of_time():
            break
        key = (cand.full.shape, cand.full.axis_names)
        if skip and key in skip or only is not None and key not in only:
            continue
        note = f"pp={cand.pp} sub-mesh {dict(zip(cand.sub.axis_names, cand.sub.shape))}"
        if cand.pp > num_units and not forced:
            failures.append((note, f"{num_units} layers < {cand.pp} stages"))
            continue
        within = opts if progress is None else replace(
            opts, time_limit_s=progress.time_limit(opts.time_limit_s))
        try:
            if not forced and (refused := refusal(cand)) is not None:
                raise refused
            if (dominated := floor_dominated(floors.get(id(cand)), progress and progress.cutoff())) is not None:
                raise dominated
            plans.append(plan_pipeline(traced, cand, mode, within, req.param_ann, req.input_ann, req.retracer))
        except (PipelineRequestError, ValueError, SolverTimeoutError) as err:   # one candidate's: the search goes on
            if forced and len(cands) == 1 and not isinstance(err, PipelineDominatedError):
                raise pipeline_nothing_fits(mesh, [(note, err)], batch) or PlanError(str(err)) from None
            err.full_key = key
            failures.append((note, err))
            if progress is not None:
                progress.record([], 1)
            continue
        if progress is not None:       # each as it comes: the time budget can stop the search between them
            progress.record(plans[-1:])
    if forced and not plans and failures and not all(isinstance(e, PipelineDominatedError) for _, e in failures):
        raise pipeline_nothing_fits(mesh, failures, batch) or PlanError(
            "no pipeline plan fits: " + "; ".join(f"{n}: {e}" for n, e in failures[:4]))
    return plans, failures, forced


__all__ = ["pipeline_plans", "pipeline_requested", "plan_pipeline", "pipeline_collectives", "unit_profiles",
           "optimizer_time"]
