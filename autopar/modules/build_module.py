"""Build this rank's module from a Plan: the pipelined module for a plan with stages, else the
per-rank program (collectives inserted, shapes localized) with its gradient sync."""
from __future__ import annotations

import copy

import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from autopar.collectives.groups import AxisGroup, axis_groups
from autopar.graph.retrace import Retracer, graph_fingerprint, microbatch_trace
from autopar.modules.mode_switch import attach
from autopar.modules.parallel_module import ParallelModule
from autopar.passes.insert_collectives import insert_collectives
from autopar.passes.localize_shapes import localize_shapes
from autopar.passes.recompute import apply_recompute, recompute_choices
from autopar.modules.pipeline_module import build_pipeline_module
from autopar.plan.plan import Plan, PlanError
from autopar.runtime.grad_sync import Accumulation, grads_by_axes, setup_grad_sync, sum_grads
from autopar.runtime.materialize import allocate_extra
from autopar.runtime.program import RankProgram, placeholder_slot
from autopar.runtime.zero import ZeroSync, check_zero_supported
from autopar.runtime.zero3 import Zero3, Zero3Runner
from autopar.frontend.trace import Traced, compute_dtype


def _forward_graph(gm: fx.GraphModule, traced: Traced) -> fx.GraphModule:
    fwd = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    out = next(n for n in fwd.graph.nodes if n.op == "output")
    out.args = (tuple(out.args[0][i] for i in traced.output_leaves),)
    fwd.graph.eliminate_dead_code()
    fwd.recompile()
    return fwd


def build_parallel_module(model: nn.Module, traced: Traced, the_plan: Plan,
                          retracer: Retracer | None = None) -> ParallelModule:
    """This rank's module for ``the_plan``; a pipelined plan re-traces at its microbatch shape with ``retracer``.
    ``pmodel.train()``/``eval()`` lower the other mode's trace with the same plan (``mode_switch.py``)."""
    module = _build_parallel_module(model, traced, the_plan, retracer)
    attach(module, model, retracer, _build_parallel_module)
    return module


def _build_parallel_module(model: nn.Module, traced: Traced, the_plan: Plan,
                           retracer: Retracer | None = None) -> ParallelModule:
    pipelined = the_plan.degrees.get("pp", 1) > 1
    check_zero_supported(the_plan, pipelined)
    if pipelined:
        return build_pipeline_module(model, traced, the_plan, retracer)
    full = traced
    if the_plan.memory_options.accumulation > 1:
        traced = _accumulation_graph(traced, the_plan, retracer)
    mesh = the_plan.mesh
    if dist.is_initialized():
        axes = axis_groups(mesh)
        coords = mesh.coords(dist.get_rank())
    else:
        axes = {n: AxisGroup(n, None, 1, 0) for n in mesh.axis_names}
        coords = tuple(0 for _ in mesh.shape)
    gm = traced.gm
    params_by_ph = {d.placeholder: (name, d) for name, d in the_plan.params.items()}
    gm, param_sync = insert_collectives(gm, the_plan, mesh.axis_names, mesh.shape, set(traced.params),
                                          traced.loss_index)
    gm = localize_shapes(gm, the_plan, mesh.shape)
    apply_recompute(gm, recompute_choices(gm, the_plan.memory_options.recompute))
    sync = {traced.params[ph]: tuple(sorted(a, key=mesh.axis_names.index)) for ph, a in param_sync.items()}
    zero = the_plan.memory_options.zero if dist.is_initialized() and mesh.size > 1 else 0
    zero3 = None
    if zero == 3:       # each layer's parameters all-gathered before its first use (runtime/zero3.py)
        zero3 = Zero3(sync, axes, mesh)
        zero3.insert(gm, {ph: name for ph, (name, _) in params_by_ph.items()})
    fwd = _forward_graph(gm, traced)
    params, buffers = {}, {}
    state = dict(model.state_dict(keep_vars=True))
    named_p = dict(model.named_parameters(remove_duplicate=False))
    named_b = dict(model.named_buffers(remove_duplicate=False))
    slots = [placeholder_slot(node.name, traced, params_by_ph, named_p, named_b, coords, mesh.shape, params, buffers)
             for node in gm.graph.nodes if node.op == "placeholder"]
    if zero3 is not None:
        zero3.shard(params)
    program = RankProgram(gm, fwd, slots, params, buffers, axes, compute_dtype(the_plan.memory_options.mixed_precision),
                          compiled=the_plan.compiled)
    named = dict(program.named_parameters())
    groups = {n: g.group for n, g in axes.items()}
    if zero3 is not None:
        zero3.bind(program)
        acc, ddp = zero3, Zero3Runner(program, zero3)
    elif zero:
        # ZeRO-1/2: every summed parameter is sharded over its sync axes (runtime/zero.py); no DDP
        acc, ddp = ZeroSync(program, sync, axes, mesh, zero, the_plan.grad_compression), None
    else:
        acc = Accumulation(list(named.values()), lambda: sum_grads(grads_by_axes(named, sync), groups))
        ddp = setup_grad_sync(program, sync, axes, mesh, acc, the_plan.grad_compression)
    used = {a for d in the_plan.params.values() for a in d.aliases}
    extra = allocate_extra({k: v.detach().clone() for k, v in state.items() if k not in used})
    return ParallelModule(program, the_plan, full, axes, coords, ddp, extra, list(state), acc,
                          microbatch=traced if traced is not full else None, zero=acc if zero else None)


def _accumulation_graph(traced: Traced, the_plan: Plan, retracer: Retracer | None) -> Traced:
    """The step re-traced at the microbatch the plan was solved on (fingerprint checked)."""
    info = the_plan.accumulation_trace
    if info is None:
        raise PlanError("the plan has memory_options.accumulation > 1 but no accumulation_trace; make a new plan")
    if retracer is None:
        raise PlanError("a plan with gradient accumulation re-traces the model at its microbatch; build it "
                        "through autopar.parallelize()")
    mb = microbatch_trace(traced, info.size, retracer, rescale=False)
    if graph_fingerprint(mb.gm) != info.fingerprint:
        raise PlanError(f"the plan's microbatch graph does not match this model traced at {info.size} rows; make a "
                        "new plan for this model")
    traced.meta.get("microbatch_traces", {}).pop(info.size, None)
    return mb
