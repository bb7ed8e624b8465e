"""PipelineModule: this rank's pipeline stage(s) of a plan with ``degrees["pp"] > 1``.

Built from the Plan alone (``build_pipeline_module``): the model is re-traced at the plan's
microbatch shape, the intra-op passes run on the whole graph, ``split_stages`` cuts it into the
plan's stages, and this rank keeps the stages whose ``ranks`` hold it.

One training step (``step``):
    the global batch is cut into ``m`` microbatches along dim 0, each is localized like a
    non-pipelined input (its own dp piece), the executor runs the schedule with the loss of
    each microbatch scaled by ``1/m`` (the in-graph loss is the microbatch mean), then
        grad sync:  each parameter's gradient is summed over its ``grad_sync`` axes (dp / tp),
                    one flat buffer per axis set, after the last backward;
        tied sync:  a parameter used on several stages (tied input/output embeddings) has its
                    gradient summed over the group of peer ranks that own it (Megatron's
                    embedding group), so every copy takes the same optimizer step;
                    under ZeRO-1 both sums are ``runtime/pipeline_zero.py``'s (ties, then the
                    reduce-scatter over dp; the all-gather after the optimizer step);
        loss:       sum_i loss_i / m on the last stage, all-reduced over its Partial axes and
                    broadcast over ``pp`` so every rank returns the global mean.
"""
from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_unflatten

from autopar.core.comm_timeout import new_group
from autopar.frontend.trace import compute_dtype
from autopar.collectives import comm
from autopar.collectives.comm import COUNTER
from autopar.collectives.groups import AxisGroup, axis_groups, bound_axes
from autopar.collectives.watch import note
from autopar.graph.retrace import Retracer, graph_fingerprint, microbatch_trace
from autopar.modules.parallel_module import ParallelModule
from autopar.modules.step_logic import _to_replicate
from autopar.passes.split_stages import forward_only, split_stages
from autopar.runtime.grad_sync import Accumulation, grads_by_axes, sum_grads
from autopar.runtime.materialize import allocate_extra
from autopar.runtime.pipeline import PipelineExecutor, StageCall
from autopar.runtime.pipeline_zero import pipeline_zero
from autopar.runtime.program import ParamTree, placeholder_slot
from autopar.runtime.step_result import step_loss
from autopar.schedules.schedule import build_schedule
from autopar.sharding.placements import Partial, local_shape, replicated, shard_factor
from autopar.sharding.shard_params import assemble


class PipelineProgram(ParamTree):
    """The parameters and buffers of this rank's stages, named like the original model."""


def _rank_info(mesh):
    if dist.is_initialized():
        return dist.get_rank(), axis_groups(mesh), mesh.coords(dist.get_rank())
    return 0, {n: AxisGroup(n, None, 1, 0) for n in mesh.axis_names}, tuple(0 for _ in mesh.shape)


def _tie_groups(owners: dict[str, list[int]], per_pp: int, my_rank: int) -> dict[tuple, object]:
    """pp coordinates owning a shared parameter -> this rank's process group over them (or None)."""
    groups = {}
    for key in sorted({tuple(v) for v in owners.values() if len(v) > 1}):
        for sub in range(per_pp):
            ranks = [c * per_pp + sub for c in key]
            g = new_group(ranks) if dist.is_initialized() else None
            if my_rank in ranks:
                groups[key] = g
    return groups


def build_pipeline_module(model: nn.Module, traced, plan, retracer: Retracer) -> "PipelineModule":
    from autopar.passes.insert_collectives import insert_collectives
    from autopar.passes.localize_shapes import localize_shapes
    from autopar.passes.recompute import apply_recompute, recompute_choices

    info = plan.pipeline
    if info is None:
        raise ValueError("a pipelined plan (degrees pp > 1) needs its pipeline info; make a new plan for this model")
    mb = microbatch_trace(traced, info.microbatch_size, retracer, rescale=False)
    if graph_fingerprint(mb.gm) != info.microbatch_fingerprint:
        raise ValueError("the plan's microbatch graph does not match this model traced at microbatch size "
                         f"{info.microbatch_size}; make a new plan for this model")
    traced.meta.get("microbatch_traces", {}).pop(info.microbatch_size, None)
    out_args = next(n for n in traced.gm.graph.nodes if n.op == "output").args[0]
    out_meta = [out_args[i].meta.get("val") if isinstance(out_args[i], torch.fx.Node) else out_args[i]
                for i in traced.output_leaves]
    mesh = plan.mesh
    pp, per_pp = mesh.shape[0], mesh.size // mesh.shape[0]
    my_rank, axes, coords = _rank_info(mesh)
    gm, param_sync = insert_collectives(mb.gm, plan, mesh.axis_names, mesh.shape, set(mb.params),
                                          mb.loss_index)
    gm = localize_shapes(gm, plan, mesh.shape)
    recompute = recompute_choices(gm, plan.memory_options.recompute)
    stage_of = {n: st.index for st in plan.stages for n in st.nodes}
    graphs, transfers = split_stages(gm, stage_of, len(plan.stages), plan, mesh.shape)
    mine = [st.index for st in plan.stages if my_rank in st.ranks]
    by_ph = {d.placeholder: (name, d) for name, d in plan.params.items()}
    named_p = dict(model.named_parameters(remove_duplicate=False))
    named_b = dict(model.named_buffers(remove_duplicate=False))
    owners: dict[str, list[int]] = {}
    for g in graphs:
        for ph in g.placeholders:
            name = mb.params.get(ph) or mb.buffers.get(ph)     # buffers too: gathered from their stage
            if name is not None:
                owners.setdefault(name, [])
                c = plan.stages[g.stage].ranks[0] // per_pp
                if c not in owners[name]:
                    owners[name].append(c)
    params, buffers, calls = {}, {}, {}
    for s in mine:
        g = graphs[s]
        slots = [placeholder_slot(ph, mb, by_ph, named_p, named_b, coords, mesh.shape, params, buffers)
                 for ph in g.placeholders]
        keep = list(mb.output_leaves) if g.results else []
        fwd = forward_only(g, keep)                 # inference: no recomputation
        apply_recompute(g.gm, recompute)
        calls[s] = StageCall(g, fwd, slots, compiled=plan.compiled)
    program = PipelineProgram(params, buffers, compute_dtype(plan.memory_options.mixed_precision))
    schedule = build_schedule(plan.schedule, pp, plan.microbatches, info.virtual_stages)
    my_sub = my_rank % per_pp

    def peer(stage: int) -> int:
        return schedule.rank_of(stage) * per_pp + my_sub

    executor = PipelineExecutor(calls, schedule, transfers, peer, my_rank, axes, mb.loss_index, mb.output_index)
    sync = {mb.params[ph]: sorted(a, key=mesh.axis_names.index) for ph, a in param_sync.items()}
    ties = _tie_groups(owners, per_pp, my_rank)
    held = {mb.params.get(ph) or mb.buffers.get(ph) for g in graphs for ph in g.placeholders}
    used = {a for name, d in plan.params.items() if name in held or d.kind == "constant" for a in d.aliases}
    state = model.state_dict(keep_vars=True)
    extra = allocate_extra({k: v.detach().clone() for k, v in state.items() if k not in used})
    return PipelineModule(program, plan, traced, axes, coords, executor, sync, owners, ties, extra, list(state),
                          mb, out_meta)


class PipelineModule(ParallelModule):
    """This rank's stages; ``step`` runs the schedule on the global batch (module docstring)."""

    def __init__(self, program, plan, traced, axes, coords, executor, sync, owners, ties, extra_state, state_keys,
                 mb_traced, out_meta):
        super().__init__(program, plan, traced, axes, coords, None, extra_state, state_keys)
        self._executor = executor
        self._sync = sync
        self._owners = owners
        self._ties = ties
        self._mb_shapes = list(mb_traced.input_shapes)
        self._mb_target_shape = mb_traced.target_shape
        self._out_meta = out_meta
        self._per_pp = plan.mesh.size // plan.mesh.shape[0]
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        zero = pipeline_zero(self, program, plan, sync, axes)
        object.__setattr__(self, "_zero", zero)
        object.__setattr__(self, "_acc", zero or Accumulation(list(program.parameters()), self._sync_grads))

    # ---- introspection ---------------------------------------------------------------------
    @property
    def code(self) -> str:
        parts = []
        for s, call in sorted(self._executor.stages.items()):
            g = call.graph
            recv = ", ".join(f"{t.value} from stage {t.src}" for t in g.recvs) or "nothing"
            send = ", ".join(f"{t.value} to stage {t.dst}" for t in g.sends) or "nothing"
            parts.append(f"# pipeline stage {s} of {len(self.plan.stages)} (schedule {self.plan.schedule}, "
                         f"{self.plan.microbatches} microbatches)\n# receives {recv}\n# sends {send}\n{g.gm.code}")
        return "\n".join(parts)

    @property
    def stages(self) -> list[int]:
        return sorted(self._executor.stages)

    @property
    def holds_every_parameter(self) -> bool:
        return False

    # ---- inputs --------------------------------------------------------------------------------
    def _batch_chunks(self) -> int:
        return self.plan.microbatches

    def _microbatches(self, inputs, target, local_batch: bool) -> list[tuple[list, object]]:
        meta, m = self._traced_meta, self.plan.microbatches
        if len(inputs) != len(meta["inputs"]):
            raise ValueError(f"the model was planned with {len(meta['inputs'])} input(s) but got {len(inputs)}")
        tph = self._target_placeholder()
        per_input = []
        for i, (x, ph, shape, mb_shape) in enumerate(zip(inputs, meta["inputs"], meta["input_shapes"],
                                                         self._mb_shapes)):
            self._check_dtype(x, i)
            per_input.append(self._split(x, self.plan.inputs.get(ph), shape, mb_shape, meta["labels"][i],
                                         local_batch))
        tgt = [None] * m
        if target is not None:
            self._check_dtype(target, None)
            tgt = self._split(target, self.plan.inputs.get(tph), meta["target_shape"], self._mb_target_shape,
                              "target", local_batch)
        return [([self.program.cast_input(xs[i]) for xs in per_input], tgt[i]) for i in range(m)]

    def _split(self, x, spec_text, global_shape, mb_shape, what, local_batch):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what} must be a tensor, got {type(x).__name__}")
        m, mesh_shape = self.plan.microbatches, self.plan.mesh.shape
        if not local_batch and tuple(x.shape) != tuple(global_shape):
            raise ValueError(f"{what} has shape {list(x.shape)} but the model was planned for the global shape "
                             f"{list(global_shape)}; pass the global batch (or local_batch=True with this rank's "
                             "part), or re-plan with example inputs of the new shape")
        chunks = x.chunk(m, 0) if m > 1 else (x,)
        return [self._localize(c, spec_text, mb_shape, what, local_batch, mesh_shape) for c in chunks]

    # ---- running -------------------------------------------------------------------------
    def step(self, *inputs, target=None, local_batch: bool = False, **kwargs) -> torch.Tensor:
        """Forward + backward of every microbatch on this rank's stages; returns the global mean loss."""
        inputs = self._flat_inputs(inputs, kwargs)
        with self._guard_step():
            return step_loss(self._pipeline_step(inputs, target, local_batch))

    def _pipeline_step(self, inputs, target, local_batch: bool) -> torch.Tensor:
        meta = self._traced_meta
        if meta["target_shape"] is not None and target is None:
            raise ValueError("step() needs target= (the model was planned with a loss_fn and example_target)")
        mbs = self._microbatches(inputs, target, local_batch)
        self._acc.before_backward()
        self.program.new_step()
        losses = self._executor.run(self.program.compute_tensor, mbs, self._loss_scale_factor() / self.plan.microbatches)
        if self._acc.syncing and self._zero is None:
            self._sync_grads()
        self._acc.after_backward()
        total = torch.stack(losses).float().sum() / self.plan.microbatches if losses else torch.zeros(())
        return self._pipeline_loss(total)

    def _pipeline_loss(self, loss: torch.Tensor) -> torch.Tensor:
        mesh = self.plan.mesh
        last = self._is_last()
        if last:
            spec = self.plan.outputs.get("loss") or replicated(len(mesh.shape))
            with bound_axes(self._axes):
                for a, p in enumerate(spec):
                    if isinstance(p, Partial):
                        loss = comm.all_reduce_value(loss, mesh.axis_names[a])
        if dist.is_initialized():
            loss = loss.detach().clone().reshape(())
            src = self._executor.peer(len(self.plan.stages) - 1)
            note("broadcast", "pp", detail=f"of the loss from rank {src}")
            dist.broadcast(loss, src=src, group=self._axes["pp"].group)
        return loss

    def _is_last(self) -> bool:
        return len(self.plan.stages) - 1 in self._executor.stages

    def _sync_grads(self) -> None:
        if not dist.is_initialized():
            return
        named = dict(self.program.named_parameters())
        sum_grads(grads_by_axes(named, self._sync), {n: g.group for n, g in self._axes.items()})
        self._sum_ties()

    def _sum_ties(self) -> None:
        """Sum the gradients of parameters held on several stages over their peers (tied embeddings)."""
        for name, coords in self._owners.items():
            group = self._ties.get(tuple(coords))
            if group is None or not self.program.has(name):
                continue
            p = self.program.local_tensor(name)
            if not p.requires_grad:
                continue
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            COUNTER.record("all_reduce", grad, "pp", "bwd")
            dist.all_reduce(grad, group=group)
            p.grad = grad

    def forward(self, *inputs, local_batch: bool = False, **kwargs):
        """Forward only: the model's output on every rank, in the structure the model returns; each tensor
        leaf is gathered in full and its microbatches concatenated along dim 0."""
        inputs = self._flat_inputs(inputs, kwargs)
        with self._guard("pmodel(...) (forward)"):
            return self._pipeline_forward(inputs, local_batch)

    def _pipeline_forward(self, inputs, local_batch: bool):
        mbs = self._microbatches(inputs, None, local_batch)
        self.program.new_step()
        outs = self._executor.run(self.program.compute_tensor, mbs, 1.0, train=False)
        specs = self._output_specs(len(self._out_meta))
        full = [self._output_leaf(j, val, spec, [o[j] for o in outs]) for j, (val, spec)
                in enumerate(zip(self._out_meta, specs))]
        return tree_unflatten(full, self._traced_meta["output_tree"])

    def _output_leaf(self, j: int, val, spec, pieces: list):
        """Leaf ``j`` of the model's output on every rank: ``val`` is its traced (global) value."""
        if not isinstance(val, torch.Tensor):
            return val
        mesh = self.plan.mesh
        if self._is_last():
            with bound_axes(self._axes), torch.no_grad():
                parts = [_to_replicate(p, spec, mesh.axis_names) if spec else p for p in pieces]
            if not val.dim() and len(parts) > 1:
                raise ValueError(f"output leaf {j} of the pipelined model is a scalar: it cannot be rebuilt from "
                                 f"{len(parts)} microbatches; return per-example values or plan one microbatch")
            full = torch.cat(parts, 0) if val.dim() else parts[0]
            if tuple(full.shape) != tuple(val.shape):
                raise ValueError(f"output leaf {j} of the pipelined model is {tuple(full.shape)} after joining "
                                 f"{len(parts)} microbatches along dim 0, but the model returns {tuple(val.shape)}: "
                                 "a pipelined forward returns outputs whose dim 0 is the batch")
        else:
            full = torch.empty(tuple(val.shape), dtype=val.dtype)
        if dist.is_initialized():
            src = self._executor.peer(len(self.plan.stages) - 1)
            note("broadcast", "pp", detail=f"of output leaf {j} from rank {src}")
            dist.broadcast(full, src=src, group=self._axes["pp"].group)
        return full

    # ---- gradients and state -----------------------------------------------------------------
    def _replicas(self, name: str) -> int:
        """Ranks holding the same piece: its shard's replicas in each stage that owns ``name``."""
        spec = self.plan.params[name].spec
        return len(self._owners.get(name, [0])) * self._per_pp // shard_factor(spec, self.plan.mesh.shape)

    def _gather(self, name: str, local: torch.Tensor | None, spec) -> torch.Tensor:
        """The full tensor from the pieces held by the ranks of the first stage owning ``name``."""
        mesh = self.plan.mesh
        shape = local_shape(tuple(self.plan.params[name].shape), spec, mesh.shape)
        dtype = local.dtype if local is not None else getattr(torch, self.plan.params[name].dtype)
        mine = local.detach().contiguous() if local is not None else torch.zeros(shape, dtype=dtype)
        if not dist.is_initialized():
            return mine.clone()
        parts = [torch.empty(shape, dtype=dtype) for _ in range(mesh.size)]
        note("all_gather", "+".join(mesh.axis_names), detail=f"of {name}")
        dist.all_gather(parts, mine, group=self._world)
        owner = self._owners.get(name, [0])[0]
        pieces = {mesh.coords(r): parts[r] for r in range(mesh.size) if r // self._per_pp == owner}
        full_pieces = {(0,) + c[1:]: v for c, v in pieces.items()}
        return assemble(full_pieces, tuple(spec), (1,) + tuple(mesh.shape[1:]))
