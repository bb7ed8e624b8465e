"""plan() and parallelize(): trace → analyze → cost → solve → apply."""
from __future__ import annotations

import copy
import dataclasses
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from autopar.modules.build_module import build_parallel_module
from autopar.collectives.watch import guard, note
from autopar.core.comm_timeout import SETUP_WAIT_S, comm_timeout_s, using, world_group
from autopar.core.context import MIXED_PRECISIONS, ParallelMode, check_comm_timeout, check_compile, get_auto_parallel_context
from autopar.core.gc_pause import fewer_collections
from autopar.graph.chunk_hints import mark_chunk_hints
from autopar.graph.retrace import Retracer, graph_fingerprint
from autopar.core.mesh import Mesh
from autopar.modules.parallel_module import ParallelModule
from autopar.plan.plan import Plan, PlanError
from autopar.runtime.agreement import check_agreement, model_summary, plan_digest, tensor_summary
from autopar.runtime.grad_sync import broadcast_state
from autopar.runtime.launch import init_from_env
from autopar.runtime.optimizer_target import note_source
from autopar.runtime.pretrained_save import remember_configs
from autopar.runtime.materialize import check_all_meta, fill_zeros, is_meta_model, keep_meta_model
from autopar.solver.annotations import ANNOTATIONS, resolve_params
from autopar.report.progress_display import ProgressDisplay
from autopar.solver.progress import SearchProgress
from autopar.solver.request import SolveRequest
from autopar.solver.search import PlanOptions, make_plans
from autopar.frontend.shared_trace import pack_traced, unpack_traced
from autopar.frontend.trace import Traced, run_device, trace


def _mode(mode) -> ParallelMode:
    return ParallelMode.parse(mode if mode is not None else get_auto_parallel_context()["parallel_mode"])


def _mixed_precision(value):
    """The call's ``mixed_precision``, else the context's (None, "bf16", "fp16")."""
    mp = get_auto_parallel_context()["mixed_precision"] if value is None else value
    if mp not in MIXED_PRECISIONS:
        raise ValueError(f"mixed_precision must be None, 'bf16' or 'fp16', got {mp!r}")
    return mp


def _compile(value) -> bool:
    """The call's ``compile``, else the context's."""
    value = get_auto_parallel_context()["compile"] if value is None else value
    check_compile(value)
    return value


def _options(mixed_precision=None, compiled: bool = False) -> PlanOptions:
    ctx = get_auto_parallel_context()
    return PlanOptions(grad_compression=ctx["grad_compression"], memory_budget_gb=ctx["memory_budget_gb"],
                       time_limit_s=ctx["solver_time_limit"], microbatches=ctx["microbatches"],
                       schedule=ctx["schedule"], virtual_stages=ctx["virtual_stages"], mixed_precision=mixed_precision,
                       accumulation=ctx["accumulation"], recompute=ctx["recompute"],
                       recompute_layers=ctx["recompute_layers"], zero=ctx["zero"], compiled=compiled,
                       moe_imbalance=ctx["moe_imbalance"],
                       precision="mixed" if mixed_precision else "fp32")


def _check_mesh(mesh) -> Mesh:
    if isinstance(mesh, int):
        return Mesh(mesh)
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be an autopar.Mesh (or a device count), got {type(mesh).__name__} {mesh!r}; "
                        "e.g. autopar.Mesh(4) or autopar.Mesh((2, 2), axis_names=('dp', 'tp'))")
    return mesh


def _warn_unused_annotations(mode: ParallelMode, stacklevel: int) -> None:
    """Annotations are set but ``mode`` ignores them (DATA, STAND_ALONE, a given plan): say so, never silently."""
    if ANNOTATIONS.empty():
        return
    warnings.warn(f"{mode} mode ignores the annotations that are set ({ANNOTATIONS.describe()}): they apply in "
                  "SEMI_AUTO and AUTO only. Call autopar.clear_annotations() if they are left from an earlier plan, "
                  "or plan with mode='semi_auto' to use them", UserWarning, stacklevel=stacklevel)


def _plan_traced(model, traced: Traced, retracer: Retracer, mesh: Mesh, mode: ParallelMode,
                 top_k: int = 1, mixed_precision=None, progress: SearchProgress | None = None,
                 warn_level: int = 4, compiled: bool = False) -> list[Plan]:
    """The ``top_k`` best predicted plans, best first (``warn_level``: the stack level of the user's call)."""
    if mode == ParallelMode.HYBRID:
        raise PlanError("HYBRID mode applies a complete plan: pass plan=<Plan or path to plan JSON>")
    if mode not in (ParallelMode.SEMI_AUTO, ParallelMode.AUTO):
        _warn_unused_annotations(mode, stacklevel=warn_level)       # the user's plan() or parallelize() call
    param_ann = resolve_params(model, ANNOTATIONS) if mode in (ParallelMode.SEMI_AUTO, ParallelMode.AUTO) else {}
    input_ann = dict(ANNOTATIONS.inputs) if mode in (ParallelMode.SEMI_AUTO, ParallelMode.AUTO) else {}
    opts = dataclasses.replace(_options(mixed_precision, compiled), progress=progress)
    return make_plans(SolveRequest(traced, model, mesh, mode, opts, param_ann, input_ann, retracer), top_k)


def plan(model: nn.Module, mesh, example_inputs=None, loss_fn=None, example_target=None, mode=None,
         mixed_precision=None, time_budget: float | None = None, progress=None, example_kwargs=None,
         compile=None) -> Plan:
    """Plan only: no processes or devices needed; the model may live on the meta device.
    ``example_kwargs``: keyword inputs of ``model.forward`` (tensors, or None / constants traced in).
    ``mixed_precision="bf16"`` / ``"fp16"``: 16-bit compute on working copies of fp32 master weights.
    ``compile``: plan programs that run through torch.compile (default: the context's).
    ``time_budget``: seconds; once they have passed (and a plan fits) the search stops and returns
    the best plan so far, which says so (``plan.search_note``, the report). ``progress``: True for
    a live line on stderr (stage, candidates, best so far), or a callable taking the search's
    ``SearchProgress`` after each change."""
    mesh = _check_mesh(mesh)
    mode = _mode(mode)
    mp = _mixed_precision(mixed_precision)
    compiled = _compile(compile)
    display = ProgressDisplay() if progress is True else None
    tracker = SearchProgress(time_budget, display or (progress if callable(progress) else None))
    tracker.enter("tracing the training step")
    try:
        with fewer_collections():
            traced = trace(model, example_inputs, loss_fn, example_target, mp, example_kwargs)
            retracer = Retracer(model, example_inputs, loss_fn, example_target, mp, example_kwargs)
            return _plan_traced(model, traced, retracer, mesh, mode, mixed_precision=mp, progress=tracker,
                                compiled=compiled)[0]
    finally:
        if display is not None:
            display.close()


def _read_plan(plan) -> Plan:
    if isinstance(plan, (str, Path)):
        plan = Plan.load(plan)
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be an autopar.Plan or a path to a plan JSON, got {type(plan).__name__}")
    return plan


def _check_plan(plan: Plan, traced: Traced, mesh: Mesh) -> Plan:
    if plan.mesh.size != mesh.size:   # AUTO may re-factor a mesh and pipelines add size-1 axes: count devices
        raise PlanError(f"the given plan was made for mesh {plan.mesh!r} ({plan.mesh.size} devices) but parallelize() "
                        f"got mesh {mesh!r} ({mesh.size} devices); apply it on a mesh of {plan.mesh.size} devices, or "
                        "make a new plan for this mesh")
    fp = graph_fingerprint(traced.gm)
    if plan.fingerprint and plan.fingerprint != fp:
        raise PlanError("the given plan was made for a different model or input shapes (graph fingerprint "
                        f"{plan.fingerprint} != {fp}); make a new plan for this model")
    return plan


# how long the other ranks wait for rank 0 to plan (torch's default timeout): planning is not
# communication, and a search may run for minutes; rank 0 dying while it plans is still seen at once
PLANNING_WAIT_S = SETUP_WAIT_S


def _planning_group():
    """Every rank, with the planning wait as timeout; made (a collective) before rank 0 starts planning."""
    return world_group(max(comm_timeout_s(), PLANNING_WAIT_S))


def _built_together() -> None:
    """Every rank has built its module before any starts its first step, waited for as long as planning
    may take: the ranks that received rank 0's graph unpack it, build and import what they had not yet
    needed after rank 0 did, so without this a short ``comm_timeout_s`` would time the first step's
    collectives out on a slower rank's set-up rather than on its communication."""
    note("barrier", detail="every rank has built its module (before the first step)")
    dist.barrier(group=_planning_group())


def _share_plans(err: Exception | None, plans: list[Plan] | None, group, graph=None) -> tuple[list[Plan], object]:
    """Rank 0's planning outcome on every rank: its plans (and ``graph``, its packed trace), or its error
    raised everywhere."""
    if group is None:
        if err is not None:
            raise err
        return plans, graph
    box = [repr(err) if err is not None else None]
    note("broadcast_object_list", detail=f"of rank 0's planning outcome (rank 0 plans while the others wait, "
                                         f"at most {max(comm_timeout_s(), PLANNING_WAIT_S):g} s)")
    dist.broadcast_object_list(box, src=0, group=group)
    if box[0] is not None:
        if err is not None:
            raise err
        raise PlanError(f"planning failed on rank 0: {box[0]}")
    box = [[p.to_json(indent=None) for p in plans] if plans is not None else None, graph]
    note("broadcast_object_list", detail="of the plans and the traced graph from rank 0")
    dist.broadcast_object_list(box, src=0, group=group)
    return [Plan.from_json(text) for text in box[0]], box[1]


def parallelize(model: nn.Module, mesh, example_inputs=None, loss_fn=None, example_target=None, mode=None,
                plan=None, mixed_precision=None, comm_timeout_s: float | None = None,
                example_kwargs=None, compile=None) -> ParallelModule:
    """Plan (on rank 0, shared with every rank) and build this rank's ParallelModule.
    ``example_kwargs``: keyword inputs of ``model.forward`` (tensors, or None / constants traced in);
    ``pmodel.step`` and ``pmodel(...)`` then take the same keywords.
    ``mixed_precision="bf16"`` / ``"fp16"``: 16-bit compute on working copies of fp32 master weights
    (fp16 with dynamic loss scaling, ``pmodel.loss_scale``; a given
    ``plan`` brings its own ``memory_options.mixed_precision``). ``compile=True``: each rank's
    program runs through torch.compile (inductor) and the plan is costed for it (default: the
    context's; a given ``plan`` brings its own ``compiled``). ``comm_timeout_s``: seconds any of
    its collectives or point-to-point waits may take before a ``CommError`` (a peer died or
    stalled); default: the context's, else the default process group's timeout."""
    check_comm_timeout(comm_timeout_s)
    if compile is not None:
        check_compile(compile)
    with using(comm_timeout_s), guard("autopar.parallelize"):
        return _parallelize(model, mesh, example_inputs, loss_fn, example_target, mode, plan, mixed_precision,
                            example_kwargs, compile)


def _parallelize(model, mesh, example_inputs, loss_fn, example_target, mode, plan, mixed_precision,
                 example_kwargs=None, compile=None) -> ParallelModule:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    mesh = _check_mesh(mesh)
    mode = _mode(mode) if plan is None or mode is not None else ParallelMode.HYBRID
    on_meta = is_meta_model(model)   # each rank allocates only its pieces; pmodel.init_weights() fills them
    if on_meta:
        check_all_meta(model)
    init_from_env()
    if dist.is_initialized():
        world = dist.get_world_size()
        if world != mesh.size:
            raise ValueError(f"mesh {mesh!r} has {mesh.size} devices but torch.distributed has {world} ranks; "
                             f"make the mesh size equal the world size (e.g. autopar.Mesh({world})), or launch "
                             f"{mesh.size} processes")
    elif mesh.size != 1:
        raise RuntimeError(f"mesh {mesh!r} has {mesh.size} devices but torch.distributed is not initialized: run "
                           "under torchrun or autopar.launch (or use a Mesh(1))")
    given = _read_plan(plan) if plan is not None else None
    _agree_at_start(model, mesh, mode, example_inputs, example_target, given, example_kwargs)
    if not on_meta:
        broadcast_state(model)       # one model on every rank, whatever each rank's seed was
    mp = _mixed_precision(mixed_precision)
    if given is not None:
        if mixed_precision is not None and mixed_precision != given.memory_options.mixed_precision:
            raise PlanError(f"parallelize(mixed_precision={mixed_precision!r}) but the given plan was made with "
                            f"mixed_precision={given.memory_options.mixed_precision!r}; drop the keyword or make a "
                            "new plan with it")
        mp = given.memory_options.mixed_precision
        if compile is not None and compile != given.compiled:
            raise PlanError(f"parallelize(compile={compile!r}) but the given plan was made with compiled="
                            f"{given.compiled!r}; drop the keyword or make a new plan with it")
    compiled = given.compiled if given is not None else _compile(compile)
    retracer = Retracer(model, example_inputs, loss_fn, example_target, mp, example_kwargs)

    def traced_here() -> Traced:
        traced = trace(model, example_inputs, loss_fn, example_target, mp, example_kwargs)
        mark_chunk_hints(traced.gm)      # every rank's graph, whether it plans or receives the plan
        return traced

    if given is not None:
        traced = _given_plan_trace(model, on_meta, traced_here)
        the_plan = _check_plan(given, traced, mesh)
        _warn_unused_annotations(ParallelMode.HYBRID, stacklevel=4)
    else:
        traced, plans = _plans_from_rank0(model, mesh, mode, mp, compiled, on_meta, retracer, traced_here)
        the_plan = plans[0]
        if len(plans) > 1:
            from autopar.modules.autotune import choose

            ctx = get_auto_parallel_context()
            the_plan = choose(plans, model, lambda m, p: _trial(build_parallel_module(m, _graph_copy(traced), p,
                                                                                  retracer), on_meta),
                              tuple(example_inputs or ()), example_target, ctx["autotune_steps"],
                              ctx["autotune_slack"], example_kwargs, one_at_a_time=on_meta)
    multi = dist.is_initialized() and dist.get_world_size() > 1
    check_agreement({"traced graph": graph_fingerprint(traced.gm), "plan": plan_digest(the_plan)},
                    "after planning", group=_planning_group() if multi else None)
    pmodel = build_parallel_module(model, traced, the_plan, retracer)
    if multi:
        _built_together()
    note_source(pmodel, model)       # an optimizer over model's own parameters is refused at its step()
    if on_meta:
        keep_meta_model(pmodel, model)
    return remember_configs(pmodel, model)      # the HF config save_pretrained writes


def _plans_from_rank0(model, mesh, mode, mp, compiled, on_meta, retracer, traced_here) -> tuple[Traced, list[Plan]]:
    """Rank 0 traces and plans while the others wait; every rank gets the plans and, where it can run it,
    rank 0's traced graph (``frontend/shared_trace.py``; else it traces the model itself)."""
    err, plans, traced, graph = None, None, None, None
    top_k = get_auto_parallel_context()["autotune_top_k"] if mode == ParallelMode.AUTO and mesh.size > 1 else 1
    group = _planning_group() if dist.is_initialized() and dist.get_world_size() > 1 else None
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        try:
            traced = traced_here()
            graph = (_device_of(model, on_meta), pack_traced(traced)) if group is not None else None
            with fewer_collections():
                plans = _plan_traced(model, traced, retracer, mesh, mode, max(1, top_k), mp, warn_level=6,
                                     compiled=compiled)
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            err = e
    try:
        plans, graph = _share_plans(err, plans, group, graph)
    except PlanError:
        if traced is None:
            traced_here()       # rank 0 failed: where this rank's own trace fails too, its error says why
        raise
    if traced is None:          # rank 0's graph, unless it holds what only rank 0 can run, or another device
        same = graph is not None and graph[1] is not None and graph[0] == _device_of(model, on_meta)
        traced = unpack_traced(graph[1]) if same else traced_here()
    return traced, plans


def _given_plan_trace(model, on_meta, traced_here) -> Traced:
    """The graph a given plan is applied to: rank 0 traces and sends it packed, as when it plans (a rank
    on another device, or a graph that cannot travel, traces itself; where rank 0's trace failed, every
    rank traces and raises its own error)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return traced_here()
    traced, err, box = None, None, [None]
    if dist.get_rank() == 0:
        try:
            traced = traced_here()
            box = [(_device_of(model, on_meta), pack_traced(traced))]
        except Exception as e:  # noqa: BLE001 - re-raised below, after the others are told
            err = e
    note("broadcast_object_list", detail="of the traced graph from rank 0 (a plan was given)")
    dist.broadcast_object_list(box, src=0, group=_planning_group())
    if err is not None:
        raise err
    if traced is None:
        graph = box[0]
        same = graph is not None and graph[1] is not None and graph[0] == _device_of(model, on_meta)
        traced = unpack_traced(graph[1]) if same else traced_here()
    return traced


def _device_of(model: nn.Module, on_meta: bool) -> str:
    """The device this rank's graph makes its own tensors on (``trace`` retargets a meta model's)."""
    return str(run_device() if on_meta else next((p.device for p in model.parameters()), torch.device("cpu")))


def _trial(pmodel: ParallelModule, on_meta: bool) -> ParallelModule:
    """A module autotune times: a meta model's pieces get zeros (finite values, no initialization)."""
    if on_meta:
        fill_zeros(pmodel)
    return pmodel


def _agree_at_start(model, mesh, mode, example_inputs, example_target, given, example_kwargs=None) -> None:
    """Every rank was started with the same versions, mesh, mode, model, examples and given plan
    (``runtime/agreement.py``): a mismatch is an error on every rank before any other collective."""
    inputs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    kwargs = example_kwargs or {}
    described = tensor_summary(inputs) + [f"{k}={v}" for k, v in zip(kwargs, tensor_summary(kwargs.values()))]
    check_agreement({"autopar version": getattr(sys.modules.get("autopar"), "__version__", None),
                     "torch version": torch.__version__, "mesh": repr(mesh), "mode": str(mode),
                     "model": model_summary(model), "example inputs": described,
                     "example target": tensor_summary([example_target]),
                     "given plan": plan_digest(given) if given is not None else None}, "at start-up")


def _graph_copy(traced: Traced) -> Traced:
    """``traced`` with its own copy of the graph (building a module rewrites the graph in place)."""
    return dataclasses.replace(traced, gm=fx.GraphModule(traced.gm, copy.deepcopy(traced.gm.graph)),
                               meta=dict(traced.meta))


__all__ = ["plan", "parallelize"]
