"""ParallelModule's state side: gradients clipped by their global norm, parameters, buffers and
gradients gathered in full from every rank's pieces, a full state dict loaded piece by piece."""
from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.collectives.watch import note
from autopar.core.errors import CheckpointError
from autopar.sharding.placements import shard_factor
from autopar.sharding.shard_params import assemble

class StateGathering:
    """Gradient norm, gathered state and gradients, full state dict loading (a mixin of ``ParallelModule``)."""

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
