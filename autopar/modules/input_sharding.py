"""ParallelModule's input side: the global batch (or this rank's part) cut into the
pieces this rank's program takes, with the data-parallel coordinates samplers need."""
from __future__ import annotations

import math

import torch

from autopar.sharding.placements import Replicate, Shard, local_shape, replicated
from autopar.sharding.shard_params import local_piece

class InputSharding:
    """Inputs to this rank's pieces (a mixin of ``ParallelModule``: uses ``plan``, ``_coords``, ``_global_meta``,
    ``_traced_meta``, ``_chunks``)."""

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

    def local_batch(self, *inputs, target=None, **kwargs):
        """This rank's part of a global batch, as ``step(..., local_batch=True)`` takes it: the rows
        ``local_batch_rows()`` and, where the plan splits other dims (the sequence over a cp axis),
        this rank's piece of them in the plan's order, the zig-zag one for causal attention
        (``Z(1)``: rank r of n holds chunks r and 2n-1-r of 2n). Returns the inputs as a tuple, and
        ``(inputs, target)`` when a target is given."""
        flat = self._flat_inputs(inputs, kwargs)
        meta = self._traced_meta
        if len(flat) != len(meta["inputs"]):
            raise ValueError(f"the model was planned with {len(meta['inputs'])} input(s) but got {len(flat)}")
        rows = torch.tensor(self.local_batch_rows())
        out = tuple(self._local_part(x, self.plan.inputs.get(ph), shape, rows, what)
                    for x, ph, shape, what in zip(flat, meta["inputs"], self._global_meta["input_shapes"],
                                                  meta["labels"]))
        if target is None:
            return out
        tph = self._target_placeholder()
        return out, self._local_part(target, self.plan.inputs.get(tph), self._global_meta.get("target_shape"), rows,
                                     "target")

    def _local_part(self, x, spec, global_shape, rows, what):
        """``local_batch``'s cut of one global tensor: its rows where dim 0 is the batch, then this
        rank's piece of every dim the plan splits on other axes."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what} must be a tensor, got {type(x).__name__}")
        if global_shape is not None and tuple(x.shape) != tuple(global_shape):
            raise ValueError(f"{what} has shape {list(x.shape)} but the model was planned for the global shape "
                             f"{list(global_shape)}; local_batch() cuts a global batch: pass one of that shape")
        mesh_shape = self.plan.mesh.shape
        spec = spec or replicated(len(mesh_shape))
        if any(p == Shard(0) for p in spec):
            x = x.index_select(0, rows.to(x.device))
        rest = tuple(Replicate() if p == Shard(0) else p for p in spec)
        return local_piece(x, rest, self._coords, mesh_shape).contiguous()

    def _batch_chunks(self) -> int:
        """How many pieces a step cuts the batch into before taking this rank's part of each."""
        return self._chunks

    def _batch_axes(self) -> list[int]:
        inputs = self._traced_meta["inputs"]
        spec = self.plan.inputs[inputs[0]] if inputs and inputs[0] in self.plan.inputs else ()
        return [a for a, p in enumerate(spec) if p == Shard(0)]

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
            spec = tuple(Replicate() if p == Shard(0) else p for p in spec)
            piece = local_shape(expect, spec, mesh_shape)
            if tuple(x.shape) == piece != tuple(expect):
                return x.contiguous()       # already this rank's piece of the other dims (``local_batch()``)
            if tuple(x.shape) != tuple(expect):
                also = f" or, cut like local_batch() cuts it, {list(piece)}" if piece != tuple(expect) else ""
                raise ValueError(f"{what} has shape {list(x.shape)} but this rank's part of the batch must be "
                                 f"{list(expect)}{also} (global {list(global_shape)}, data-parallel size {dp}); the "
                                 "plan is specialised to the example input shapes: re-plan for another shape")
        elif tuple(x.shape) != tuple(global_shape):
            raise ValueError(f"{what} has shape {list(x.shape)} but the model was planned for the global shape "
                             f"{list(global_shape)}; pass the global batch (or local_batch=True with this rank's "
                             "part), or re-plan with example inputs of the new shape")
        return local_piece(x, spec, self._coords, mesh_shape).contiguous()

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
