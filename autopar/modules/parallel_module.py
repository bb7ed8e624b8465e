"""ParallelModule: what ``autopar.parallelize`` returns on each rank.

The class holds the rank's program, plan and groups and the torch-facing surface (parameters,
train/eval, code); its jobs live in one mixin each: ``InputSharding`` (inputs to this rank's
pieces), ``StepLogic`` (step, forward, the global loss), ``StateGathering`` (gradient norm,
gathered state and gradients) and ``CheckpointGlue`` (checkpoints and weights)."""
from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn

from autopar.frontend.call_inputs import TENSOR, CallSignature
from autopar.collectives.watch import guard
from autopar.core.comm_timeout import comm_timeout_s, world_group
from autopar.modules.checkpoint_glue import CheckpointGlue
from autopar.modules.input_sharding import InputSharding
from autopar.modules.state_gather import StateGathering
from autopar.modules.step_logic import StepLogic
from autopar.runtime import idle_rank
from autopar.runtime.loss_scale import make_scaler
from autopar.runtime.optimizer_check import watch
from autopar.runtime.program import RankProgram
from autopar.runtime.step_result import check_trainable
from autopar.sharding.placements import shard_factor


class ParallelModule(InputSharding, StepLogic, StateGathering, CheckpointGlue, nn.Module):
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


    # ---- running -------------------------------------------------------------------------


    # ---- fp16 loss scaling (runtime/loss_scale.py) ---------------------------------------------


    # ---- gradients -------------------------------------------------------------------------


    # ---- state -------------------------------------------------------------------------------


def _meta(traced) -> dict:
    signature = traced.signature or CallSignature(tuple(TENSOR for _ in traced.inputs))
    return {"inputs": list(traced.inputs), "input_shapes": list(traced.input_shapes),
            "signature": signature, "labels": signature.labels,
            "target_shape": traced.target_shape, "loss_index": traced.loss_index,
            "has_loss": traced.has_loss, "output_tree": traced.output_tree,
            "input_dtypes": list(traced.input_dtypes), "target_dtype": traced.target_dtype}
