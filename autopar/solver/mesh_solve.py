"""Solve one mesh: the intra-op problem of a traced model under a mode's restrictions → Plan.

``_allowed`` turns the mode (DATA, SEMI_AUTO annotations, AUTO axis roles) into the strategies
each node may take; ``solve_on_mesh`` builds the costed problem, solves it and decodes a Plan.
``search.py`` (AUTO's mesh factorisations) and ``pipeline_search.py`` (each stage's sub-mesh)
both call it.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch

from autopar.core import search_memo
from autopar.cost_models.devices import mesh_device
from autopar.core.context import ParallelMode
from autopar.cost_models.compute import total_flops
from autopar.cost_models.memory import training_state_parts
from autopar.cost_models.zero import zero_axes, zero_collectives
from autopar.sharding.grad_sync import grad_sync_rule, trainable_params
from autopar.graph.layers import find_layers, tie_groups
from autopar.graph.retrace import graph_fingerprint
from autopar.core.mesh import Mesh
from autopar.plan.plan import CandidateError, Collective, MemoryOptions, Plan, PlanError
from autopar.sharding.candidates import build_candidates
from autopar.sharding.placements import R, Replicate, Shard, shard_factor
from autopar.solver.annotations import restrict_op_strategies
from autopar.solver.context_axes import fed_by_inputs, keep_sequence_split, sequence_order
from autopar.solver.decode import ChosenSpecs, decode, loss_output, loss_report_collectives, output_specs
from autopar.solver.degrees import axis_shares, degrees_of, role
from autopar.solver.axis_descent import solve_with_start
from autopar.solver.data_start import batch_split_allowed, data_allowed
from autopar.solver.intra_op import (DominatedError, InfeasibleError, SolverTimeoutError, edge_memory, evaluate,
                                     solve_intra_op)
from autopar.solver.moe_axes import ROLE_EXPERT, expert_axis_choices, nodes_moe
from autopar.solver.memory_terms import accumulated_grad_bytes, op_transients, transient_bytes, zero_layer_buffers
from autopar.solver.request import PlanOptions, SolveRequest
from autopar.solver.problem import activation_weighted, build_problem, resharded_param_bytes, resharded_region_inputs
from autopar.solver.strategy_prices import Costing, grad_sync_overhead, sync_element_bytes, tensor_bytes
from autopar.solver.seq_parallel import resharded_saved_activations
from autopar.graph.recompute_regions import choices_for, find_regions


def _allowed(traced, cands, mesh: Mesh, mode: ParallelMode, param_ann: dict, input_ann: dict) -> dict:
    allowed: dict[str, list[int]] = {}

    def only(name, pred):
        idx = [i for i, st in enumerate(cands.strategies[name]) if pred(st.output)]
        allowed[name] = idx
        return idx

    if mode == ParallelMode.STAND_ALONE:
        for name, strategies in cands.strategies.items():
            allowed[name] = [i for i, st in enumerate(strategies)
                             if all(all(isinstance(p, Replicate) for p in s) for s in list(st.inputs) + _outs(st))]
        return allowed
    if mode == ParallelMode.DATA:
        for ph in traced.inputs + ([traced.target] if traced.target else []):
            shape = tuple(traced.node(ph).meta["val"].shape)
            if not shape:
                continue
            if shape[0] % mesh.size:
                raise CandidateError(f"the global batch ({shape[0]}, dim 0 of input {ph!r}) is not divisible by the "
                                f"data-parallel size {mesh.size}; use a batch that is a multiple of {mesh.size}")
            split, sizes = _batch_split(shape), tuple(mesh.shape)
            only(ph, lambda spec: all(p == split for p, n in zip(spec, sizes) if n > 1))
        for ph in list(traced.params) + list(traced.buffers) + list(traced.constants):
            only(ph, lambda spec: all(isinstance(p, Replicate) for p in spec))
        _keep_batch_split(traced, cands, allowed, tuple(mesh.shape))
    if mesh.named and mode in (ParallelMode.AUTO, ParallelMode.SEMI_AUTO):
        _axis_roles(traced, cands, mesh, input_ann, only)
        expert_axis_choices(traced, cands, mesh, allowed)
        keep_sequence_split(traced, cands, mesh, input_ann, allowed, only)
    by_canon = {}
    for ph, pname in traced.params.items():
        for alias in traced.aliases.get(pname, [pname]):
            by_canon[alias] = ph
    by_canon.update({b: ph for ph, b in traced.buffers.items()})
    annotated_axes: dict[str, list[int]] = {}
    for pname, placements in param_ann.items():
        ph = by_canon.get(pname)
        if ph is None:
            raise PlanError(f"annotated parameter {pname!r} is not used by the traced model")
        _check_axes(pname, placements, mesh, tuple(traced.node(ph).meta["val"].shape))
        idx = only(ph, lambda spec, pl=_on_real_axes(placements, mesh): all(spec[mesh.axis_index(a)] == p
                                                                          for a, p in pl.items()))
        if not idx:
            raise PlanError(f"no valid placement of {pname!r} satisfies {_fmt(placements)}")
        annotated_axes[ph] = [mesh.axis_index(a) for a in _on_real_axes(placements, mesh)]
    if annotated_axes:
        _use_as_stored(traced, cands, allowed, set(annotated_axes), annotated_axes)
    for i, placements in input_ann.items():
        if i >= len(traced.inputs):
            raise PlanError(f"shard_input({i}) but the model has {len(traced.inputs)} input(s)")
        ph = traced.inputs[i]
        _check_axes(f"input {i}", placements, mesh, tuple(traced.node(ph).meta["val"].shape))
        only(ph, lambda spec, pl=_on_real_axes(placements, mesh): all(spec[mesh.axis_index(a)] == p
                                                                      for a, p in pl.items()))
    if mode == ParallelMode.SEMI_AUTO:
        restrict_op_strategies(traced, cands, mesh, allowed)
    return allowed


ROLE_DATA, ROLE_TENSOR = ("dp", "data", "batch"), ("tp", "tensor", "model", "mp")


def _on_real_axes(placements: dict, mesh: Mesh) -> dict:
    """An annotation's placements on the axes of size > 1 (on an axis of size 1 every tensor is whole)."""
    return {a: p for a, p in placements.items() if mesh.shape[mesh.axis_index(a)] > 1}


def _axis_roles(traced, cands, mesh: Mesh, input_ann: dict, only) -> None:
    """Named axes carry their role: "dp" shards the batch of every input, "tp" keeps inputs whole;
    an expert axis ("ep", ``moe_axes.ROLE_EXPERT``) is a data axis for them (``expert_axis_choices``
    keeps its experts split)."""
    data = [i for i, n in enumerate(mesh.axis_names) if n in ROLE_DATA + ROLE_EXPERT]
    tensor = [i for i, n in enumerate(mesh.axis_names) if n in ROLE_TENSOR]
    if not data and not tensor:
        return
    phs = list(enumerate(traced.inputs)) + ([(None, traced.target)] if traced.target else [])
    for i, ph in phs:
        if i in input_ann:
            continue
        shape = tuple(traced.node(ph).meta["val"].shape)
        dp = math.prod(mesh.shape[a] for a in data)
        if data and shape and shape[0] % dp:
            raise CandidateError(f"the global batch ({shape[0]}, dim 0 of {ph!r}) is not divisible by the data-parallel "
                            f"size {dp} (mesh axes {[mesh.axis_names[a] for a in data]}); use a batch that is a "
                            f"multiple of {dp}")
        only(ph, lambda spec, s=shape: all(spec[a] == _batch_split(s) for a in data if mesh.shape[a] > 1)
             and all(isinstance(spec[a], Replicate) for a in tensor))


def _batch_split(shape: tuple) -> Shard | Replicate:
    """How a data-parallel axis holds an input: Shard(0); whole for a scalar, and for a batch of one row
    (then every data-parallel axis has size 1, the same layout; no candidate shards a dim of size 1)."""
    return Shard(0) if shape and shape[0] > 1 else R


def _keep_batch_split(traced, cands, allowed: dict, sizes: tuple) -> None:
    """DATA: every op downstream of the inputs runs on its rank's part of the batch (no output
    Replicate on any axis of size > 1); ops without such a strategy (no rule) keep their options."""
    for name in fed_by_inputs(traced):
        strategies = cands.strategies.get(name)
        if not strategies:
            continue
        keep = [i for i, st in enumerate(strategies)
                if all(not isinstance(p, Replicate) for spec in _outs(st) for p, n in zip(spec, sizes) if n > 1)]
        if keep:
            allowed[name] = keep
    _use_as_stored(traced, cands, allowed, set(traced.params) | set(traced.buffers), None)


def _use_as_stored(traced, cands, allowed: dict, placeholders: set, axes: dict | None) -> None:
    """Consumers of these placeholders take them as stored (no resharding of the weight):
    DATA keeps weights whole (axes None: every axis); an annotated weight is used in its
    annotated placement, as torch's ColwiseParallel/RowwiseParallel mean."""
    from autopar.sharding.strategy import tensor_inputs

    for node in traced.gm.graph.nodes:
        if node.op != "call_function" or node.name not in cands.strategies:
            continue
        slots = [(i, a.name) for i, a in enumerate(tensor_inputs(node)) if a.name in placeholders]
        if not slots:
            continue
        stored = {ph: cands.strategies[ph][allowed[ph][0]].output for _, ph in slots
                  if ph in allowed and len(allowed[ph]) == 1}
        if not stored:
            continue
        current = allowed.get(node.name, range(len(cands.strategies[node.name])))
        keep = []
        for k in current:
            st = cands.strategies[node.name][k]
            ok = True
            for i, ph in slots:
                if ph not in stored:
                    continue
                check = range(len(stored[ph])) if axes is None else axes.get(ph, ())
                ok &= all(st.inputs[i][a] == stored[ph][a] for a in check)
            if ok:
                keep.append(k)
        if keep:
            allowed[node.name] = keep


def _fmt(placements: dict) -> str:
    return "{" + ", ".join(f"{a}: {p}" for a, p in placements.items()) + "}"


def _check_axes(what: str, placements: dict, mesh: Mesh, shape: tuple) -> None:
    for ax, p in placements.items():
        if ax not in mesh.axis_names:
            raise PlanError(f"{what}: unknown mesh axis {ax!r}; the mesh has axes {mesh.axis_names} (name one of "
                            "them, or call autopar.clear_annotations() if this annotation is left from an earlier "
                            "plan)")
        if isinstance(p, Shard):
            if not -len(shape) <= p.dim < len(shape):
                raise PlanError(f"{what}: Shard({p.dim}) is out of range for a tensor of shape {list(shape)}")
            size, n = shape[p.dim], mesh.axis_size(ax)
            if size % (n * p.chunks):
                raise PlanError(f"{what}: dimension {p.dim} of size {size} is not divisible by the size {n} of "
                                f"mesh axis {ax!r}; choose another dim or a mesh axis that divides it")


def _outs(st):
    o = st.output
    return list(o) if o and isinstance(o[0], tuple) else [o]


def solve_on_mesh(req: SolveRequest, microbatches: int = 1, cutoff: float | None = None,
                  activation_weight: float = 1.0, ranks_per_node: int | None = None, explain: bool = True) -> Plan:
    """The plan of ``req.traced`` on ``req.mesh`` in ``req.mode`` (its options and annotations; its
    model and retracer are not used). ``ranks_per_node``: ranks sharing a node (default: this mesh's); a pipeline stage's
    sub-mesh passes the whole mesh's, since every stage runs at the same time. ``traced`` is one
    microbatch of a step that runs ``microbatches`` of them (accumulation, or a pipeline's): the
    solver minimises the whole step, in which the gradient sync and optimizer step run once
    (``BuiltProblem.per_step``). ``cutoff``: the best whole-step time so far; a candidate whose
    lower bound (``microbatches`` x its unbudgeted per-step optimum) reaches it raises
    ``DominatedError`` instead of being solved under the budget. ``activation_weight``: the budget
    counts what a microbatch holds (saved activations, gathered copies) that many times
    (``problem.activation_weighted``; a pipeline's whole-model layout); the plan's memory is then in
    those units. ``explain``: False where the caller discards an ``InfeasibleError`` (no least-memory solve
    behind it: ``IntraOpProblem.explain``)."""
    t0 = time.perf_counter()
    traced, mesh, mode, opts = req.traced, req.mesh, req.mode, req.opts
    device = mesh_device(mesh)
    per_node = ranks_per_node or min(mesh.size, mesh.gpus_per_node or mesh.size)
    device = device.shared_by(per_node).with_compile(opts.compiled)  # CPU ranks beyond the core count share the cores
    cands, param_ann, input_ann = sequence_order(traced, mesh, _candidates(traced, mesh.shape), req.param_ann,
                                                 req.input_ann)
    allowed = _allowed(traced, cands, mesh, mode, param_ann, input_ann)
    redistribution, memo, tables = traced.meta.setdefault("costing_memo", {}).setdefault(
        (mesh.shape, repr(device), id(cands)), ({}, {}, {}))     # the zig-zag candidates cost apart
    costing = Costing(mesh.shape, device, opts.optimizer, opts.precision, frozen_buffers=set(traced.buffers),
                      recompute=opts.recompute or "none", zero=opts.zero or 0, microbatches=microbatches,
                      grad_element_bytes=sync_element_bytes(opts.precision, opts.grad_compression),
                      moe_imbalance=opts.moe_imbalance, _redistribution=redistribution, _memo=memo, _tables=tables)
    ties = _ties(traced)
    budget = opts.memory_budget_gb * 2**30 if opts.memory_budget_gb else device.memory_bytes
    built = build_problem(traced.gm, cands, costing, set(traced.params), allowed, ties, budget, opts.time_limit_s)
    built.problem.data_allowed = data_allowed(built.names, batch_split_allowed(traced, cands, mesh, allowed))
    built.problem.explain = explain
    held = step_input_bytes(traced, microbatches)
    try:
        sol, gathered, transient = _solve_within(traced, cands, built, costing, budget - held, microbatches, cutoff,
                                                 activation_weight=activation_weight)
        layers = zero_layer_buffers(traced.gm, cands, built, sol.choice, costing, traced.params)
        copies = gathered_activation_copies(traced, cands, built, sol.choice, costing)
    except InfeasibleError as err:
        if getattr(err, "choice", None) is not None:
            err.breakdown = {**memory_parts(traced, cands, built, err.choice, costing), "inputs": held}
        raise
    nodes, params, inputs, colls = decode(traced.gm, cands, built, sol.choice, costing, mesh.axis_names, traced)
    outputs = output_specs(traced.gm, nodes, params, inputs, traced)
    colls += loss_report_collectives(traced.gm, outputs, mesh.axis_names, traced)
    colls = zero_collective_list(colls, opts.zero or 0, set(traced.params), costing, mesh.axis_names)
    last_bucket = grad_sync_overhead(costing, [(mesh.axis_names.index(a), c.bytes) for c in colls
                                               if c.node in traced.params for a in c.axes])
    shares = axis_shares(traced.gm, nodes, inputs, mesh.axis_names, mesh.shape)
    roles = {a: role(s) for a, s in shares.items()}
    return Plan(mode=mode, mesh=mesh, degrees=degrees_of(roles, mesh.axis_names, mesh.shape, nodes), axis_roles=roles,
                nodes=nodes, params=params,
                inputs=inputs, outputs=outputs, step_time=sol.objective + last_bucket, flops=total_flops(traced.gm),
                memory_per_device=[float(sol.memory) + gathered + transient + held] * mesh.size, memory_bound=sol.bound,
                step_floor=max(0.0, sol.free_bound),
                memory_breakdown=_breakdown(built, sol, traced, MemoryExtras(
                    (gathered - layers) / activation_weight - copies, transient, layers, costing.zero, held,
                    zero_unsynced_bytes(traced, cands, built, sol.choice, costing),
                    accumulated_grad_bytes(traced.gm, cands, built, sol.choice, costing, traced.params), copies)),
                solve_time=time.perf_counter() - t0,
                solver_status=sol.status, unknown_ops=dict(cands.unknown_ops),
                grad_compression=opts.grad_compression, compiled=opts.compiled, optimizer=opts.optimizer,
                memory_budget=budget,
                grad_sync_overhead=last_bucket, axis_shares=shares,
                once_per_step_time=built.once_time(sol.choice) + last_bucket,
                options={"precision": opts.precision, "solver_vars": sol.num_vars,
                         **({"moe_imbalance": opts.moe_imbalance} if nodes_moe(nodes) else {})},
                memory_options=MemoryOptions(mixed_precision=opts.mixed_precision,
                                             reduce_dtype="bf16" if opts.grad_compression == "bf16" else "fp32",
                                             recompute=opts.recompute or "none", zero=opts.zero or 0),
                fingerprint=graph_fingerprint(traced.gm), collective_list=colls)


def gathered_activation_copies(traced, cands, built, choice: list[int], costing: Costing) -> float:
    """``seq_parallel.resharded_saved_activations`` of an assignment (recomputed regions save nothing); kept
    per assignment on ``built`` (one solve's problem and costing: the solve and the plan ask for the same one)."""
    memo = built.__dict__.setdefault("activation_copies", {}) if search_memo.ENABLED else {}
    if tuple(choice) in memo:
        return memo[tuple(choice)]
    memo[tuple(choice)] = _activation_copies(traced, cands, built, choice, costing)
    return memo[tuple(choice)]


def _activation_copies(traced, cands, built, choice: list[int], costing: Costing) -> float:
    inside: set = set()
    if costing.recompute not in (None, "none"):
        inside = {n for r in find_regions(traced.gm, choices_for(traced.gm.graph, costing.recompute)) for n in r.nodes}
    return resharded_saved_activations(traced.gm, cands, built, choice, costing, set(traced.params), tensor_bytes,
                                       inside)


def step_input_bytes(traced, microbatches: int = 1) -> float:
    """Bytes of the step's inputs and target on every rank for the whole step: ``pmodel.step`` takes
    the global batch on each rank (``microbatches`` times the traced microbatch's)."""
    names = [*traced.inputs, *([traced.target] if traced.target else [])]
    by_name = {n.name: n for n in traced.gm.graph.nodes}
    vals = [by_name[n].meta.get("val") for n in names if n in by_name]
    return float(microbatches * sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor)))


def _ties(traced) -> list[list[str]]:
    """The repeated layers' tie groups of ``traced``'s graph, once per graph (every mesh and memory
    option the search solves it on asks for the same groups)."""
    key = (id(traced.gm.graph), len(traced.gm.graph.nodes))
    kept = traced.meta.get("tie_groups")
    if kept is None or kept[0] != key or not search_memo.ENABLED:
        names = dict(traced.params)
        names.update(traced.buffers)
        kept = traced.meta["tie_groups"] = (key, tie_groups(find_layers(traced.gm, names)))
    return kept[1]


def _candidates(traced, mesh_shape: tuple):
    """``build_candidates`` once per (traced step, mesh shape): the search solves one graph on one
    mesh under several memory options (ZeRO stages, recomputation), and its node costs and
    resharding tables (``traced.meta["costing_memo"]``) are shared the same way."""
    cache = traced.meta.setdefault("candidates", {})
    key = (tuple(mesh_shape), id(traced.gm.graph), len(traced.gm.graph.nodes))
    if key not in cache:
        cache[key] = build_candidates(traced.gm, mesh_shape)
    return cache[key]


def zero_collective_list(colls: list[Collective], stage: int, params: set[str], costing: Costing,
                         axis_names: tuple) -> list[Collective]:
    """The list under ZeRO ``stage``: each parameter's gradient sync becomes the reduce-scatter and
    all-gathers of ``cost_models.zero.zero_collectives`` (what ``runtime/zero.py`` runs; its
    buckets pad the last chunk, so the bytes that run may exceed these by up to d-1 elements per
    bucket), each with its bucketed time as the ILP costs it."""
    if not stage:
        return colls
    out = []
    for c in colls:
        if c.node not in params or c.kind != "all_reduce":
            out.append(c)
            continue
        for kind, _, phase in zero_collectives(1, 2, stage):
            seconds = sum(costing.bucketed(kind, c.bytes, axis_names.index(a)) for a in c.axes)
            out.append(dataclasses.replace(c, kind=kind, phase=phase, axes=list(c.axes), time=seconds))
    return out


SOLVE_TRIES = 6     # solves of one mesh's problem under ever lower limits (``_solve_within``)


def _solve_within(traced, cands, built, costing: Costing, budget: float, microbatches: int = 1,
                  cutoff: float | None = None, activation_weight: float = 1.0):
    """Solve, then add what the ILP's memory row does not hold exactly: ZeRO's per-layer buffers
    (``zero_layer_buffers``) and the largest op's backward transients (a maximum each, not a sum), and the gathered
    parameter copies counted once per (parameter, placement) where the row charges them per edge
    (``resharded_param_bytes``, never more than the row's). While the sum exceeds ``budget``, the
    ILP's budget is lowered by the two maxima of the last solution (or, when that no longer
    lowers it, by the overflow) and the problem solved again (``SOLVE_TRIES`` solves at most). Returns (solution with its memory
    row's bytes less the edges', gathered copies + ZeRO layer buffers, transients). The problem solved is
    the per-step one (``BuiltProblem.per_step``); the solution's objective is one microbatch's.
    The first solve keeps room for lower bounds of the transients (``op_transients``) where the
    budget binds, so that it usually fits; where that room makes it infeasible (the row charges a
    gathered parameter per edge, the total once, so row + room can exceed the budget when the
    total does not), it is solved without. The lowered re-solves keep the cutoff (a lower limit only
    removes assignments, so a bound that reaches it holds for the plan returned) but no such room: their limit
    already leaves the last solution's transients out. The solution's ``free_bound`` (and an error's
    ``step_floor``) is the whole step's: ``microbatches`` x the per-step problem's unbudgeted bound,
    a floor of this mesh's step at any budget (``Plan.step_floor``; -inf where none was proven)."""
    params = set(traced.params)
    whole = activation_weighted(built.per_step(microbatches), built.names, params, activation_weight)
    limit = budget
    problem = dataclasses.replace(whole, cutoff=None if cutoff is None else cutoff / microbatches,
                                  transient=op_transients(traced.gm, cands, built, costing, traced.params))
    smallest = None                 # (total bytes, choice) of the smallest assignment tried
    floor = -math.inf               # the whole step's proven floor at any budget (``Plan.step_floor``)
    for _ in range(SOLVE_TRIES):
        try:
            sol = solve_with_start(problem, solve_intra_op)
            floor = max(floor, microbatches * sol.free_bound)
        except (InfeasibleError, DominatedError, SolverTimeoutError) as err:
            floor = err.step_floor = max(floor, microbatches * getattr(err, "free_bound", -math.inf))
            if not isinstance(err, InfeasibleError):
                raise
            if problem.transient is not None and getattr(err, "least_memory", None) is None:
                problem = dataclasses.replace(problem, transient=None)   # not proven by the row alone:
                continue                # the row charges gathered copies per edge, the total once
            if smallest is not None and (err.choice is None or sum(
                    memory_parts(traced, cands, built, err.choice, costing).values()) > smallest[0]):
                err.choice = smallest[1]
            raise
        if limit < budget:          # solved under a lowered limit: the budget shaped it
            sol = dataclasses.replace(sol, bound=True)
        node_bytes = sol.memory - edge_memory(whole, sol.choice) + zero_unsynced_bytes(traced, cands, built,
                                                                                       sol.choice, costing)
        resharded = activation_weight * (resharded_param_bytes(traced.gm, cands, built, sol.choice, costing, params)
                                         + resharded_region_inputs(traced.gm, cands, built, sol.choice, costing)
                                         + gathered_activation_copies(traced, cands, built, sol.choice, costing))
        layer_buffers = zero_layer_buffers(traced.gm, cands, built, sol.choice, costing, traced.params)
        transient = transient_bytes(traced.gm, cands, built, sol.choice, costing, traced.params)
        gathered = resharded + layer_buffers
        over = node_bytes + gathered + transient - budget
        if over <= 0:
            break
        if smallest is None or over + budget < smallest[0]:
            smallest = (over + budget, sol.choice)
        lowered = min(limit, budget - layer_buffers - transient)
        limit = lowered if lowered < limit else min(limit, sol.memory - over)
        problem = dataclasses.replace(whole, memory_budget=limit, cutoff=problem.cutoff)   # the cutoff holds
    else:
        err = InfeasibleError(
            f"no strategy assignment fits the memory budget of {budget / 2**30:.3f} GiB ({budget:.4g} B): the best "
            f"found keeps {node_bytes:.4g} B of state and activations plus {gathered:.4g} B of gathered parameters "
            f"and {transient:.4g} B of backward transients. Use more devices, pipeline parallelism, activation "
            "checkpointing or optimizer-state sharding, or raise the budget")
        err.choice = smallest[1]
        err.step_floor = floor
        raise err
    objective = evaluate(built.problem, sol.choice)[0] if microbatches > 1 else sol.objective
    return dataclasses.replace(sol, memory=node_bytes, objective=objective, free_bound=floor), gathered, transient


def zero_unsynced_bytes(traced, cands, built, choice: list[int], costing: Costing) -> float:
    """``zero_unsynced_parts`` summed."""
    return sum(zero_unsynced_parts(traced, cands, built, choice, costing))


def zero_unsynced_parts(traced, cands, built, choice: list[int], costing: Costing) -> tuple[float, float, float]:
    """Bytes of training state a rank holds beyond the ILP's node memory under ZeRO: the ILP shards
    a parameter's state over every axis it is replicated on (``zero_axes``), the runtime over the
    axes its gradient is summed on (``grad_sync``, ``runtime/zero.py``): a parameter replicated on an
    axis that does not sum its gradient (a row-parallel layer's bias, whose gradient every rank
    holds whole) keeps its state whole there. Returns (parameters, gradients, optimizer state) bytes."""
    if not costing.zero:
        return 0.0, 0.0, 0.0
    chosen = {n: cands.strategies[n][choice[i]] for i, n in enumerate(built.names)}
    shape = costing.mesh_shape
    rule = grad_sync_rule(traced.gm.graph, trainable_params(traced.gm.graph, set(traced.params),
                                                            loss_output(traced.gm, traced)),
                          ChosenSpecs(chosen), len(shape))
    by_name = {n.name: n for n in traced.gm.graph.nodes}
    extra = [0.0, 0.0, 0.0]
    for ph in traced.params:
        if ph not in chosen:
            continue
        axes, d = zero_axes(chosen[ph].output, shape)
        synced = rule.param_axes.get(ph, frozenset())
        d_sync = math.prod(shape[a] for a in axes if a in synced)
        if d_sync == d:
            continue
        v = by_name[ph].meta["val"]
        w, g, o = training_state_parts(v.numel() / shard_factor(chosen[ph].output, shape), v.dtype,
                                       costing.optimizer, costing.precision)
        for i, (part, stage) in enumerate(((w, 3), (g, 2), (o, 1))):
            if costing.zero >= stage:
                extra[i] += part / d_sync - part / d
    return extra[0], extra[1], extra[2]


def memory_parts(traced, cands, built, choice: list[int], costing: Costing) -> dict[str, float]:
    """Per-device bytes of an assignment by kind: parameters, gradients, optimizer state (each as
    its ZeRO stage leaves it), activations, gathered parameters, backward transients."""
    by_name = {n.name: n for n in traced.gm.graph.nodes}
    out = dict.fromkeys(("parameters", "gradients", "optimizer state", "activations"), 0.0)
    for i, name in enumerate(built.names):
        st = cands.strategies[name][choice[i]]
        if name not in traced.params:
            out["activations"] += float(built.problem.nodes[i].memory[choice[i]])
            continue
        v = by_name[name].meta["val"]
        shards = shard_factor(st.output, costing.mesh_shape)
        w, g, o = training_state_parts(v.numel() / shards, v.dtype, costing.optimizer, costing.precision)
        d = zero_axes(st.output, costing.mesh_shape)[1] if costing.zero else 1
        out["parameters"] += w / (d if costing.zero >= 3 else 1)
        out["gradients"] += g / (d if costing.zero >= 2 else 1)
        out["optimizer state"] += o / (d if costing.zero >= 1 else 1)
    for key, part in zip(("parameters", "gradients", "optimizer state"),
                         zero_unsynced_parts(traced, cands, built, choice, costing)):
        out[key] += part
    params = set(traced.params)
    out["activations"] += gathered_activation_copies(traced, cands, built, choice, costing)
    out["gathered parameters"] = (resharded_param_bytes(traced.gm, cands, built, choice, costing, params)
                                  + resharded_region_inputs(traced.gm, cands, built, choice, costing)
                                  + zero_layer_buffers(traced.gm, cands, built, choice, costing, traced.params))
    accumulated = accumulated_grad_bytes(traced.gm, cands, built, choice, costing, traced.params)
    out["transient"] = transient_bytes(traced.gm, cands, built, choice, costing, traced.params) - accumulated
    if accumulated:
        out["accumulated gradients"] = accumulated
    return out


@dataclass(frozen=True)
class MemoryExtras:
    """What a device holds beyond the ILP's node memory, by kind (``_breakdown``)."""
    gathered: float = 0.0
    transient: float = 0.0
    layers: float = 0.0
    zero: int = 0
    inputs: float = 0.0
    unsynced: float = 0.0
    accumulated: float = 0.0
    copies: float = 0.0


def _breakdown(built, sol, traced, extras: MemoryExtras) -> dict:
    """Peak bytes per device: parameter training state vs activations kept for backward, plus
    ``extras`` (``gathered``: parameters kept in a placement other than the stored one, see
    ``resharded_param_bytes``; ``transient``: the largest op's gradients in backward,
    ``transient_bytes``, of which ``accumulated`` (``accumulated_grad_bytes``: the data-parallel
    gradients' second copy under several microbatches) is listed on its own; ``layers``: ZeRO-3's
    gathered layer and its prefetched successor, or ZeRO-2's gradient bucket in backward,
    ``zero_layer_buffers``; ``copies``: saved activations kept gathered, counted with the activations,
    ``seq_parallel.resharded_saved_activations``; ``unsynced``: ``zero_unsynced_bytes``; ``inputs``:
    ``step_input_bytes``)."""
    x = extras
    state = acts = 0.0
    for i, name in enumerate(built.names):
        mem = float(built.problem.nodes[i].memory[sol.choice[i]])
        if name in traced.params:
            state += mem
        else:
            acts += mem
    out = {"params+grads+optimizer": state + x.unsynced, "activations": acts + x.copies}
    if x.gathered:
        out["gathered parameters"] = x.gathered
    if x.layers:
        out["ZeRO-3 gathered layers" if x.zero == 3 else "ZeRO-2 gradient bucket"] = x.layers
    out["transient"] = x.transient - x.accumulated
    if x.accumulated:
        out["accumulated gradients"] = x.accumulated
    if x.inputs:
        out["inputs"] = x.inputs
    return out
