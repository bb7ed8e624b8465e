"""ZeRO-1 for a pipeline stage (``plan.memory_options.zero == 1`` with ``degrees["pp"] > 1``).

Megatron-LM's distributed optimizer and DeepSpeed's pipeline engine run this stage with pipelines:
each stage's parameters are sharded over their data-parallel axes exactly as ``runtime/zero.py``
shards a whole program's (same layout, buckets and collectives), and the gradient sum runs once,
after the schedule's last backward (the microbatches' gradients add up in the working gradients
meanwhile). ZeRO-2 and 3 would reduce-scatter or gather in every microbatch; they are refused
with a pipeline (``cost_models.zero.PIPELINE_ZERO``, ``runtime.zero.check_zero_supported``).

A parameter used on several stages (tied input/output embeddings) is first summed over the
stages that hold it (``tie_sum``: the pipeline's embedding groups, as without ZeRO), then
reduce-scattered over its stage's data-parallel ranks: every stage's shard then holds the same
sum and takes the same optimizer step. The tie sum is over this step's gradients only: the
already-summed shard gradient of a tied parameter (steps accumulated without ``zero_grad``) is set
aside before backward and added back after the reduce-scatter, so it is not summed twice. A tied
parameter with no data-parallel axis is not sharded: its working gradient holds the summed total,
which is set aside the same way (after a synced step; ``no_sync`` steps add local parts only).
"""
from __future__ import annotations

from typing import Callable

import torch

from autopar.plan.plan import PlanError
from autopar.runtime.zero import ZeroSync


class PipelineZero(ZeroSync):
    """``ZeroSync`` (stage 1) over one pipeline rank's stage parameters (module docstring).

    ``tied``: the names of this rank's parameters that other stages hold too; ``tie_sum``: sums
    their working gradients over those stages (in place)."""

    def __init__(self, program, sync: dict, groups: dict, mesh, stage: int, tied: set[str],
                 tie_sum: Callable[[], None], compression: str | None = None):
        if stage != 1:
            raise PlanError(f"memory_options.zero={stage} is not supported with a pipeline (pp > 1): use zero=1 or 0")
        super().__init__(program, sync, groups, mesh, stage, compression)
        self._tie_sum = tie_sum
        self._tied = sorted(n for n in tied if n in self.sharded)
        named = dict(program.named_parameters())
        # tied parameters not sharded (no data-parallel axis): their working gradient holds the summed total
        self._whole = {n: named[n] for n in sorted(tied) if n not in self.sharded and n in named}
        self._held: dict[str, torch.Tensor] = {}

    def before_backward(self) -> None:
        was_local = self.local
        super().before_backward()
        for name, p in self._whole.items():
            if p.grad is None:
                self._held.pop(name, None)      # the user zeroed it: nothing summed is kept
            elif not was_local:                 # the total summed so far: set aside, not summed again
                self._held[name] = p.grad.detach().clone()
                p.grad.zero_()
        if was_local and not self.local:
            self._held = {k: v for k, v in self._held.items() if k in self._whole}  # the user zeroed the shards
        if self.local:
            return              # no_sync steps' local gradients wait to be summed with this step's
        for name in self._tied:
            sp = self.sharded[name][1]
            if sp.shard.grad is None:
                continue
            held = sp.shard.grad.detach().clone()
            self._held[name] = held if name not in self._held else self._held[name].add_(held)
            sp.shard.grad = None
            if sp.working.grad is not None:
                sp.working.grad.zero_()

    def reduce_scatter(self) -> None:
        self._tie_sum()
        super().reduce_scatter()
        for name, held in self._held.items():
            t = self._whole[name] if name in self._whole else self.sharded[name][1].shard
            t.grad = held if t.grad is None else t.grad.add_(held)
        self._held = {}


def pipeline_zero(pmodel, program, plan, sync: dict, groups: dict) -> PipelineZero | None:
    """The ZeRO-1 sync of a pipeline rank (None without ZeRO, one process or one device):
    ``pmodel._sum_ties`` sums the tied parameters over their stages."""
    import torch.distributed as dist

    zero = plan.memory_options.zero
    if not zero or not dist.is_initialized() or plan.mesh.size == 1:
        return None
    tied = {name for name, coords in pmodel._owners.items() if len(coords) > 1}
    return PipelineZero(program, sync, groups, plan.mesh, zero, tied, pmodel._sum_ties, plan.grad_compression)
