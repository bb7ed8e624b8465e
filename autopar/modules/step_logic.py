"""ParallelModule's step and forward: the program run on this rank's inputs, the loss summed
over the ranks that hold parts of it, accumulation and fp16 loss scaling around backward."""
from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.collectives import comm
from autopar.collectives.groups import bound_axes, group_name
from autopar.collectives.watch import note
from autopar.plan.plan import PlanError
from autopar.runtime.step_result import step_loss
from autopar.sharding.placements import Partial, Replicate, replicated
from autopar.sharding.redistribute import redistribute_steps

class StepLogic:
    """Training step and forward (a mixin of ``ParallelModule``)."""

    def step(self, *inputs, target=None, local_batch: bool = False, **kwargs) -> torch.Tensor:
        """Forward + backward on this rank's part of the global batch; returns the global mean loss.
        ``kwargs``: the model's keyword inputs, as planned (``example_kwargs``).
        A plan with accumulation k runs it as k microbatches one after another (each loss scaled by
        1/k, gradients summed locally and synced once, with the last)."""
        inputs = self._flat_inputs(inputs, kwargs)
        with self._guard_step():
            if self._chunks == 1:
                return step_loss(self._step(inputs, target, local_batch))   # backward() on it: a clear error
            chunks = self._accumulation_chunks(inputs, target, local_batch)
            losses = []
            for j, (xs, t) in enumerate(chunks):
                with self.no_sync() if j < len(chunks) - 1 else contextlib.nullcontext():
                    losses.append(self._step(xs, t, local_batch, 1.0 / len(chunks)))
            return step_loss(torch.stack(losses).mean())

    def _step(self, inputs, target, local_batch: bool, scale: float = 1.0) -> torch.Tensor:
        meta = self._traced_meta
        if not meta["has_loss"]:
            raise ValueError("step() needs a loss: pass loss_fn= and example_target= to parallelize, "
                             "or use a model whose forward returns a scalar loss")
        if meta["target_shape"] is not None and target is None:
            raise ValueError("step() needs target= (the model was planned with a loss_fn and example_target)")
        xs, tgt = self._local_inputs(inputs, target, local_batch)
        runner = self._ddp if self._ddp is not None else self.program
        acc = self._acc
        if acc is not None:
            acc.before_backward()
        quiet = self._ddp is not None and acc is not None and not acc.syncing
        if getattr(self._ddp, "process_group", None) is not None:      # torch's DDP (not ZeRO-3's runner)
            note("broadcast", group_name(self._ddp.process_group, "dp"), "fwd",
                 detail="that DDP runs in its first forward to agree on its gradient buckets")
        with self._ddp.no_sync() if quiet else contextlib.nullcontext():
            loss = runner(*xs, target=tgt)[meta["loss_index"]]   # the model's other outputs (logits) die here
            report = self._start_global_loss(loss)      # the loss report overlaps backward
            scale *= self._loss_scale_factor()
            (loss * scale if scale != 1.0 else loss).backward()
        if acc is not None:
            acc.after_backward()
        return self._finish_global_loss(*report)

    def no_sync(self):
        """Steps in this block keep their gradients local (no communication), like DDP's
        ``no_sync``. The gradients still add up exactly like single-device ``loss.backward()``
        calls: the first step after the block, ``clip_grad_norm_``, ``full_grad_dict`` or any
        optimizer's ``step()`` sums them. Without it every step sums its own gradient."""
        return self._acc.no_sync() if self._acc is not None else contextlib.nullcontext()

    def _flush_grads(self) -> None:
        if self._acc is not None:
            self._acc.flush()

    @property
    def scaler(self):
        """The dynamic loss scaler under ``mixed_precision="fp16"`` (None otherwise)."""
        return self._scaler

    @property
    def loss_scale(self) -> float | None:
        """The factor the next ``step`` multiplies the loss by (fp16), else None."""
        return self._scaler.scale if self._scaler is not None else None

    def _loss_scale_factor(self) -> float:
        return self._scaler.before_backward() if self._scaler is not None else 1.0

    def _unscale_grads(self) -> None:
        if self._scaler is not None:
            self._scaler.unscale()

    def _partial_loss_axes(self) -> list[str]:
        spec = self.plan.outputs.get("loss") or replicated(len(self.plan.mesh.shape))
        return [self.plan.mesh.axis_names[a] for a, p in enumerate(spec) if isinstance(p, Partial)]

    def _start_global_loss(self, loss: torch.Tensor):
        """Start summing the loss (in fp32) over its first Partial axis; (value, work, remaining axes)."""
        axes = self._partial_loss_axes()
        loss = loss.detach().float()
        if not axes:
            return loss.detach(), None, []
        with bound_axes(self._axes):
            value, work = comm.all_reduce_value_start(loss, axes[0])
        return value, work, axes[1:]

    def _finish_global_loss(self, value: torch.Tensor, work, rest: list[str]) -> torch.Tensor:
        if work is not None:
            work.wait()
        with bound_axes(self._axes):
            for name in rest:
                value = comm.all_reduce_value(value, name)
        return value

    def forward(self, *inputs, local_batch: bool = False, **kwargs):
        """Forward only: the model's output, in the structure the model returns, each tensor gathered in full
        (with accumulation, the microbatches' outputs joined along dim 0)."""
        inputs = self._flat_inputs(inputs, kwargs)
        with self._guard("pmodel(...) (forward)"):
            if self._chunks > 1:
                outs = [tree_flatten(self._forward(xs, local_batch))[0]
                        for xs, _ in self._accumulation_chunks(inputs, None, local_batch)]
                return tree_unflatten([_join(j, [o[j] for o in outs]) for j in range(len(outs[0]))],
                                      self._traced_meta["output_tree"])
            return self._forward(inputs, local_batch)

    def _forward(self, inputs, local_batch: bool):
        xs, _ = self._local_inputs(inputs, None, local_batch)
        leaves = self.program(*xs, target=None, forward_only=True)
        names = self.plan.mesh.axis_names
        with bound_axes(self._axes):
            full = [_to_replicate(x, spec, names) if isinstance(x, torch.Tensor) and spec else x
                    for x, spec in zip(leaves, self._output_specs(len(leaves)))]
        return tree_unflatten(full, self._traced_meta["output_tree"])

    def _output_specs(self, n: int) -> list:
        specs = self.plan.output_specs()
        if len(specs) != n:
            raise PlanError(f"the plan places {len(specs)} model output(s) but the model returns {n} leaves; "
                            "make a new plan for this model")
        return specs


def _join(j: int, parts: list):
    """Output leaf ``j`` of every accumulation microbatch joined along dim 0 (the batch)."""
    if not isinstance(parts[0], torch.Tensor):
        return parts[0]
    if not parts[0].dim():
        raise ValueError(f"output leaf {j} is a scalar: it cannot be rebuilt from {len(parts)} accumulation "
                         "microbatches; return per-example values or plan without accumulation")
    return torch.cat(parts, 0)


def _to_replicate(x: torch.Tensor, spec, axis_names) -> torch.Tensor:
    target = tuple(Replicate() for _ in spec)
    fns = {"all_reduce": lambda t, s: comm.all_reduce(t, axis_names[s.axis]),
           "all_gather": lambda t, s: comm.all_gather(t, s.dim, axis_names[s.axis], s.chunks, s.zigzag),
           "all_to_all": lambda t, s: comm.all_to_all(t, s.dim, s.dst_dim, axis_names[s.axis])}
    for st in redistribute_steps(spec, target):
        x = fns[st.kind](x, st)
    return x
