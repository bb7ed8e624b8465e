"""ParallelModule: what ``autopar.parallelize`` returns on each rank."""
from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.frontend.call_inputs import TENSOR, CallSignature
from autopar.collectives import comm
from autopar.collectives.groups import bound_axes, group_name
from autopar.collectives.watch import guard, note
from autopar.core.comm_timeout import comm_timeout_s, using, world_group
from autopar.core.errors import CheckpointError
from autopar.plan.plan import PlanError
from autopar.runtime import idle_rank
from autopar.runtime.loss_scale import make_scaler
from autopar.runtime.optimizer_check import watch
from autopar.runtime.program import RankProgram
from autopar.runtime.step_result import check_trainable, step_loss
from autopar.sharding.placements import Partial, Replicate, Shard, replicated, shard_factor
from autopar.sharding.redistribute import redistribute_steps
from autopar.sharding.shard_params import assemble, local_piece


class ParallelModule(nn.Module):
    """This rank's part of the model: ``step`` trains, ``forward`` infers, both on the global batch."""

    def __init__(self, program: RankProgram, plan, traced, axes, coords, ddp=None, extra_state=None,
                 state_keys=None, accumulation=None, microbatch=None, zero=None):
        """``microbatch``: the step traced at the plan's accumulation microbatch, which ``program``
        runs ``plan.memory_options.accumulation`` times per step (None: no accumulation)."""
        super().__init__()
        self.program = program
        self.plan = plan
        self._global_meta = _meta(traced)
        self._traced_meta = _meta(microbatch if microbatch is not None else traced)
        self._chunks = plan.memory_options.accumulation if microbatch is not None else 1
        self._axes = axes
        self._coords = coords
        object.__setattr__(self, "_ddp", ddp)
        self._extra_state = extra_state or {}
        self._state_keys = state_keys or []
        object.__setattr__(self, "_acc", accumulation)
        object.__setattr__(self, "_zero", zero)      # runtime.zero.ZeroSync under plan.memory_options.zero
        self.comm_timeout_s = comm_timeout_s()       # the timeout its groups were made with (autopar.comm_timeout)
        object.__setattr__(self, "_world", world_group() if dist.is_initialized() else None)
        self._steps = 0
        object.__setattr__(self, "_scaler", make_scaler(self, plan))   # fp16: runtime/loss_scale.py
        watch(self)                                  # optimizers that need whole parameters are refused by name

    def _guard(self, what: str):
        """Where a peer rank dies or stalls past ``comm_timeout_s``, raise a ``CommError`` naming ``what``."""
        return guard(what, self.comm_timeout_s)

    def _guard_step(self):
        check_trainable(self.plan)                   # a clear error where nothing takes a gradient
        self._steps += 1
        return self._guard(f"pmodel.step (step {self._steps} of this process)")

    def train(self, mode: bool = True):
        """Train or eval mode, as ``model.train()``/``model.eval()`` on one device: dropout, batch norm and
        ``self.training`` branches switch; the first switch to a mode traces and lowers it once
        (``mode_switch.py``). Every rank switches together."""
        from autopar.modules.mode_switch import switch

        with self._guard(f"pmodel.{'train' if mode else 'eval'}() (its first call lowers that mode)"):
            switch(self, mode)
        return super().train(mode)

    # ---- introspection -------------------------------------------------------------------
    @property
    def code(self) -> str:
        """This rank's training program as Python, collectives included."""
        return self.program.gm.code

    @property
    def mesh(self):
        return self.plan.mesh

    @property
    def data_parallel_size(self) -> int:
        """How many parts the global batch is cut into (the mesh axes where the first input is Shard(0));
        a sampler gives each part to the ranks of one ``data_parallel_rank``."""
        return math.prod(self.plan.mesh.shape[a] for a in self._batch_axes())

    @property
    def data_parallel_rank(self) -> int:
        """Which part of the global batch this rank takes (``local_batch=True`` expects that part)."""
        rank = 0
        for a in self._batch_axes():
            rank = rank * self.plan.mesh.shape[a] + self._coords[a]
        return rank

    @property
    def global_batch_size(self) -> int:
        """Rows of the global batch the plan was made for (dim 0 of the first input)."""
        shapes = self._global_meta["input_shapes"]
        return shapes[0][0] if shapes and shapes[0] else 1

    def local_batch_rows(self) -> list[int]:
        """Which rows of the global batch, in order, make this rank's part: what ``step(..., local_batch=True)``
        takes. Each microbatch (pipeline, accumulation) is cut from it exactly as from the global batch,
        so training on these rows equals training on the global batch; ranks with one
        ``data_parallel_rank`` get the same rows."""
        mesh_shape = self.plan.mesh.shape
        spec = tuple(Shard(0) if a in self._batch_axes() else Replicate() for a in range(len(mesh_shape)))
        rows = torch.arange(self.global_batch_size)
        chunks = rows.chunk(self._batch_chunks()) if self._batch_chunks() > 1 else (rows,)
        return torch.cat([local_piece(c, spec, self._coords, mesh_shape) for c in chunks]).tolist()

    def _batch_chunks(self) -> int:
        """How many pieces a step cuts the batch into before taking this rank's part of each."""
        return self._chunks

    def _batch_axes(self) -> list[int]:
        inputs = self._traced_meta["inputs"]
        spec = self.plan.inputs[inputs[0]] if inputs and inputs[0] in self.plan.inputs else ()
        return [a for a, p in enumerate(spec) if p == Shard(0)]

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The program's parameters; under ZeRO, this rank's shards of the data-parallel ones."""
        if self._zero is not None:
            return self._zero.params.named_parameters(prefix=prefix, recurse=recurse,
                                                      remove_duplicate=remove_duplicate)
        return self.program.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def parameters(self, recurse: bool = True):
        """What an optimizer trains: ``named_parameters()``'s, or, on a rank whose pipeline stage holds
        none, one zero-size placeholder that never gets a gradient (runtime/idle_rank.py)."""
        return idle_rank.parameters(self, recurse)

    def split_parameters(self) -> dict[str, str]:
        """The parameters (of ``parameters()``) that are pieces of a larger tensor: name -> how it is split."""
        out, mesh = {}, self.plan.mesh
        for name, _ in self.named_parameters():
            d = self.plan.params.get(name)
            if self._zero is not None and self._zero.handles(name):
                out[name] = f"a ZeRO-{self.plan.memory_options.zero} shard over the data-parallel ranks"
            elif d is not None and shard_factor(d.spec, mesh.shape) > 1:
                out[name] = f"placed {d.spec} on mesh axes {tuple(mesh.axis_names)}"
        return out

    @property
    def holds_every_parameter(self) -> bool:
        """Whether every parameter of the model is on this rank (in pieces or whole): not so in a pipeline."""
        return True

    # ---- inputs ------------------------------------------------------------------------------
    def _flat_inputs(self, inputs: tuple, kwargs: dict) -> tuple:
        """The call's tensors in the graph's input order (``call_inputs.CallSignature``): keyword tensors
        follow the positional ones; None and constants must be the ones traced (or left out)."""
        return tuple(self._global_meta["signature"].flatten(inputs, kwargs))

    def _local_inputs(self, inputs, target, local_batch: bool):
        meta = self._traced_meta
        if len(inputs) != len(meta["inputs"]):
            raise ValueError(f"the model was planned with {len(meta['inputs'])} input(s) but got {len(inputs)}")
        out = []
        shape_mesh = self.plan.mesh.shape
        for i, (x, ph, shape) in enumerate(zip(inputs, meta["inputs"], meta["input_shapes"])):
            self._check_dtype(x, i)
            out.append(self._localize(x, self.plan.inputs.get(ph), shape, meta["labels"][i], local_batch,
                                      shape_mesh))
        tgt = None
        if target is not None:
            self._check_dtype(target, None)
            tph = self._target_placeholder()
            tgt = self._localize(target, self.plan.inputs.get(tph), meta["target_shape"], "target", local_batch,
                                 shape_mesh)
        return out, tgt

    def _target_placeholder(self):
        known = set(self._traced_meta["inputs"])
        return next((k for k in self.plan.inputs if k not in known), None)

    def _check_dtype(self, x, index: int | None) -> None:
        """Input ``index`` (None: the target) has the dtype of the example it was planned with."""
        meta = self._traced_meta
        if index is None:
            what, want, shape = "target", meta["target_dtype"], meta["target_shape"]
        else:
            dtypes = meta["input_dtypes"]
            what, shape = meta["labels"][index], meta["input_shapes"][index]
            want = dtypes[index] if index < len(dtypes) else None
        if want is None or not isinstance(x, torch.Tensor) or x.dtype == want:
            return
        raise TypeError(f"{what} has dtype {x.dtype} but the model was planned with an example of dtype {want} "
                        f"(shape {list(shape)}); pass a {want} tensor (e.g. .to({want})), or re-plan with an "
                        "example of this dtype")

    def _localize(self, x, spec, global_shape, what, local_batch, mesh_shape):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what} must be a tensor, got {type(x).__name__}")
        spec = spec or replicated(len(mesh_shape))
        if local_batch:
            dp = math.prod(mesh_shape[a] for a, p in enumerate(spec) if p == Shard(0))
            expect = (global_shape[0] // dp,) + tuple(global_shape[1:]) if global_shape else ()
            if tuple(x.shape) != tuple(expect):
                raise ValueError(f"{what} has shape {list(x.shape)} but this rank's part of the batch must be "
                                 f"{list(expect)} (global {list(global_shape)}, data-parallel size {dp}); the plan is "
                                 "specialised to the example input shapes: re-plan for another shape")
            spec = tuple(Replicate() if p == Shard(0) else p for p in spec)
        elif tuple(x.shape) != tuple(global_shape):
            raise ValueError(f"{what} has shape {list(x.shape)} but the model was planned for the global shape "
                             f"{list(global_shape)}; pass the global batch (or local_batch=True with this rank's "
                             "part), or re-plan with example inputs of the new shape")
        return local_piece(x, spec, self._coords, mesh_shape).contiguous()

    # ---- running -------------------------------------------------------------------------
    def _accumulation_chunks(self, inputs, target, local_batch: bool) -> list[tuple]:
        """The global batch (or this rank's part) cut into the plan's k microbatches along dim 0."""
        k, meta = self._chunks, self._global_meta
        if len(inputs) != len(meta["inputs"]):
            raise ValueError(f"the model was planned with {len(meta['inputs'])} input(s) but got {len(inputs)}")
        for x, shape, what in zip(inputs, meta["input_shapes"], meta["labels"]):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{what} must be a tensor, got {type(x).__name__}")
            if not local_batch and tuple(x.shape) != tuple(shape):
                raise ValueError(f"{what} has shape {list(x.shape)} but the model was planned for the global shape "
                                 f"{list(shape)} (run as {k} accumulated microbatches); pass the global batch, or "
                                 "re-plan with example inputs of the new shape")
            if x.shape[0] % k:
                raise ValueError(f"{what} has {x.shape[0]} rows, which the plan's {k} accumulation microbatches "
                                 "do not divide")
        parts = [x.chunk(k, 0) for x in inputs]
        targets = target.chunk(k, 0) if target is not None else [None] * k
        return [(tuple(p[j] for p in parts), targets[j]) for j in range(k)]

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

    # ---- fp16 loss scaling (runtime/loss_scale.py) ---------------------------------------------
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

    # ---- gradients -------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global gradient norm over all shards (2-norm or inf-norm): every rank adds its
        pieces' ``|g|^p`` divided by how many ranks hold that same piece (``_replicas``)."""
        with self._guard("pmodel.clip_grad_norm_"):
            return self._clip_grad_norm(max_norm, norm_type)

    def _clip_grad_norm(self, max_norm: float, norm_type: float) -> torch.Tensor:
        self._flush_grads()
        self._unscale_grads()
        local = torch.zeros((), dtype=torch.float64)
        grads = []
        for grad, replicas in self._grad_pieces():
            grads.append(grad)
            g = grad.detach().double()
            if norm_type == math.inf:
                local = torch.maximum(local, g.abs().max())
            else:
                local += (g.abs() ** norm_type).sum() / replicas
        if dist.is_initialized() and dist.get_world_size() > 1:
            note("all_reduce", "+".join(self.plan.mesh.axis_names), "step", detail="of the gradient norm")
            dist.all_reduce(local, op=dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM,
                            group=self._world)
        total = local if norm_type == math.inf else local ** (1.0 / norm_type)
        coef = float(max_norm) / (float(total) + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return total.float()

    def _grad_pieces(self) -> list:
        """(gradient, how many ranks hold that same piece) for each gradient this rank holds."""
        if self._zero is not None:
            return self._zero.grad_pieces(self.program, self._replicas)
        return [(p.grad, self._replicas(name)) for name, p in self.program.named_parameters() if p.grad is not None]

    def _replicas(self, name: str) -> float:
        """How many ranks hold the same piece of parameter ``name``."""
        world = self.plan.mesh.size
        spec = self.plan.params[name].spec if name in self.plan.params else ()
        return world / shard_factor(spec, self.plan.mesh.shape) if spec else world

    def _trainable(self, name: str) -> bool:
        """A parameter that gets a gradient (``requires_grad`` and a path to the loss; the plan says)."""
        return self.plan.params[name].trainable

    # ---- state -------------------------------------------------------------------------------
    def _local(self, name: str) -> torch.Tensor | None:
        """This rank's piece of ``name`` (None where this rank holds none of it)."""
        if self._zero is not None and self._zero.handles(name):
            return self._zero.working(name)
        return self.program.local_tensor(name) if self.program.has(name) else None

    def _gather(self, name: str, local: torch.Tensor, spec) -> torch.Tensor:
        """The full tensor from every rank's piece (a collective over all ranks)."""
        mesh = self.plan.mesh
        local = local.detach()
        if shard_factor(spec, mesh.shape) == 1 or not dist.is_initialized():
            return local.clone()
        parts = [torch.empty_like(local) for _ in range(mesh.size)]
        note("all_gather", "+".join(mesh.axis_names), detail=f"of {name}")
        dist.all_gather(parts, local.contiguous(), group=self._world)
        return assemble({mesh.coords(r): parts[r] for r in range(mesh.size)}, spec, mesh.shape)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer gathered in full; same keys and shapes as model.state_dict()."""
        with self._guard("pmodel.full_state_dict"):
            return self._full_state_dict()

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, d in self.plan.params.items():
            if d.kind == "constant" or all(a in self._extra_state for a in d.aliases):
                continue     # a tensor no stage holds (unused) keeps its initial value
            full = self._gather(name, self._local(name), d.spec)
            for alias in d.aliases:
                out[alias] = full
        for k, v in self._extra_state.items():
            out.setdefault(k, v.clone())
        if self._state_keys:
            out = {k: out[k] for k in self._state_keys if k in out}
        return out

    def sync_to(self, model: nn.Module) -> None:
        """Copy the trained state (gathered in full) into ``model``, the module this was built from, in place,
        on every rank: training updates pmodel's own tensors, not the original model's. A collective: call it
        on every rank (runtime/sync_back.py)."""
        from autopar.runtime.sync_back import sync_to

        sync_to(model, self.full_state_dict)

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter's gradient gathered in full (canonical names; zeros where none)."""
        with self._guard("pmodel.full_grad_dict"):
            return self._full_grad_dict()

    def _full_grad_dict(self) -> dict[str, torch.Tensor]:
        self._flush_grads()
        self._unscale_grads()
        out = {}
        for name, d in self.plan.params.items():
            if d.kind != "parameter" or not self._trainable(name):
                continue
            p = self._local(name)
            if p is not None and self._zero is not None and self._zero.handles(name):
                g = self._zero.local_grad(name)
            else:
                g = None if p is None else (p.grad if p.grad is not None else torch.zeros_like(p))
            out[name] = self._gather(name, g, d.spec)
        return out

    def load_full_state_dict(self, state) -> None:
        """Load a full (unsharded) state dict: each rank reads only its pieces. ``state`` is a dict of
        tensors, or a path to one on disk (``torch.save`` file, memory-mapped; ``.safetensors`` file or
        a directory of them, read lazily), so a plain checkpoint loads without any rank reading it whole."""
        from autopar.runtime.state_files import open_state_dict, read_piece, shape_of

        where = ""
        if isinstance(state, (str, os.PathLike)):
            where, state = f" in {state}", open_state_dict(state)
        mesh = self.plan.mesh
        for name, d in self.plan.params.items():
            if d.kind == "constant" or not self.program.has(name):
                continue
            key = next((a for a in d.aliases if a in state), None)
            if key is None:
                raise KeyError(f"state dict{where} has no entry for {name!r} (or its aliases {d.aliases})")
            src = state[key]
            if shape_of(src) != tuple(d.shape):
                raise CheckpointError(f"tensor {key!r} has shape {list(shape_of(src))}{where or ' in the state dict'} "
                                      f"but {list(d.shape)} in this model: it comes from a model of another "
                                      "configuration (vocabulary, hidden size, ...); build the model like that one")
            piece = read_piece(src, d.spec, self._coords, mesh.shape)
            if self._zero is not None and self._zero.handles(name):
                self._zero.load_piece(name, piece)
                continue
            with torch.no_grad():
                self.program.local_tensor(name).copy_(piece)
        if self._zero is not None:
            self._zero.refresh_shards()

    def load_pretrained(self, path, *, prefix: str | None = None, rename=None, strict: bool = True):
        """Load a Hugging Face checkpoint directory (safetensors, sharded or not) or a torch state-dict
        file: each rank reads only its pieces, names mapped by ``prefix`` / ``rename``, values cast to
        the model's dtypes; all or nothing (runtime/pretrained_load.py). Optimizer state is untouched."""
        from autopar.runtime.pretrained_load import load_pretrained

        with self._guard("pmodel.load_pretrained"), using(self.comm_timeout_s):
            return load_pretrained(self, path, prefix=prefix, rename=rename, strict=strict)

    def save_pretrained(self, directory, *, max_shard_size="5GB", config=True, prefix: str | None = None,
                        rename=None, dtype=None):
        """Write a Hugging Face checkpoint (safetensors + ``config.json``) that ``from_pretrained`` loads,
        streamed one tensor at a time to rank 0, never the whole model on one rank; atomic
        (runtime/pretrained_save.py)."""
        from autopar.runtime.pretrained_save import save_pretrained

        with self._guard("pmodel.save_pretrained"), using(self.comm_timeout_s):
            return save_pretrained(self, directory, max_shard_size=max_shard_size, config=config, prefix=prefix,
                                   rename=rename, dtype=dtype)

    def init_weights(self, seed: int = 0) -> None:
        """For a model given on the meta device: fill this rank's pieces with what building the model on
        one CPU under ``torch.manual_seed(seed)`` gives, bit for bit (runtime/init_weights.py)."""
        from autopar.runtime.init_weights import init_weights

        init_weights(self, seed)

    def save(self, path, optimizer=None, *, step: int | None = None, async_: bool = False):
        """Save a sharded checkpoint (a directory): each rank writes its pieces of the model and of
        ``optimizer``'s state, with its RNG state and ``step`` (default: the optimizer's). It loads under
        any plan and world size (``load``). Atomic: a failed save leaves the previous checkpoint. With
        ``async_=True`` it returns once the state is copied, with a future that completes when the
        checkpoint is in place (runtime/checkpoint.py)."""
        from autopar.runtime.checkpoint import save_checkpoint

        with using(self.comm_timeout_s):
            return save_checkpoint(self, path, optimizer, step=step, async_=async_)

    def load(self, path, optimizer=None) -> int | None:
        """Load a checkpoint saved by ``save`` under any plan and world size: this rank's pieces of the
        model (and of the optimizer state, into ``optimizer``, built like the saving one) and its RNG
        state. Returns the step the checkpoint recorded."""
        from autopar.runtime.checkpoint import load_checkpoint

        with using(self.comm_timeout_s):
            return load_checkpoint(self, path, optimizer)


def _meta(traced) -> dict:
    signature = traced.signature or CallSignature(tuple(TENSOR for _ in traced.inputs))
    return {"inputs": list(traced.inputs), "input_shapes": list(traced.input_shapes),
            "signature": signature, "labels": signature.labels,
            "target_shape": traced.target_shape, "loss_index": traced.loss_index,
            "has_loss": traced.has_loss, "output_tree": traced.output_tree,
            "input_dtypes": list(traced.input_dtypes), "target_dtype": traced.target_dtype}


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
           "all_gather": lambda t, s: comm.all_gather(t, s.dim, axis_names[s.axis], s.chunks),
           "all_to_all": lambda t, s: comm.all_to_all(t, s.dim, s.dst_dim, axis_names[s.axis])}
    for st in redistribute_steps(spec, target):
        x = fns[st.kind](x, st)
    return x
