"""torch's own runs of an oracle job that sum in another order: the noise bar of docs/testing.md.

Where a plan reorders sums, a parallel run cannot meet single-device training bit for bit; there
the bar is how far torch's own runs of the same job land, measured in the same test:

* ``torch_dp_run`` (on every rank of a pool): DDP in fp32, FSDP2 with
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` under mixed precision;
* ``split_linear_run`` (one process): every ``nn.Linear`` computed as a Megatron split writes it in
  plain torch, its weight in 2 x 2 blocks (the input-feature halves' partial products summed, as a
  row-parallel layer sums them; the output halves concatenated, so backward sums the input gradient
  from two halves, as a column-parallel layer does). Data parallelism reorders sums over the batch,
  tensor parallelism over features: only this run reorders those.

Both return what ``oracle.reference_run`` does.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from oracle import LR, STEPS, _chunks, _train, make_optimizer, reference_run


def splits(batch: int, micro: int, world: int, accumulate: int = 1) -> bool:
    """Whether every micro-batch of ``batch`` rows (cut ``micro`` x ``accumulate`` ways) splits evenly over
    ``world`` ranks."""
    return batch % (micro * accumulate) == 0 and (batch // (micro * accumulate)) % world == 0


def torch_dp_run(rank, model_fn, loss_fn, x, y, steps: int = STEPS, optim: str = "sgd", micro: int = 1,
                 clip: float | None = None, lr: float | None = None, mixed_precision: str | None = None,
                 accumulate: int = 1):
    """DDP (or FSDP2 under ``mixed_precision="bf16"``) over every rank of the default group, each rank
    on its rows of every micro-batch; losses are the global means, gradients and parameters gathered.
    ``accumulate``: each micro-batch runs as that many backward passes of ``loss / accumulate`` (as a
    plan's accumulation or pipeline microbatches do), its loss the mean of theirs."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = model_fn()
    if mixed_precision:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        wrapped = fully_shard(model, mesh=init_device_mesh("cpu", (world,)), mp_policy=policy)
    else:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
    opt = make_optimizer(model.parameters(), optim, lr if lr is not None else LR[optim])
    xs, ys = _chunks(x, micro), _chunks(y, micro)

    def step(m):
        total = torch.zeros(())
        for xa, ya in zip(xs[m].chunk(accumulate), ys[m].chunk(accumulate)):
            loss = loss_fn(wrapped(xa.chunk(world)[rank]), ya.chunk(world)[rank])
            (loss / accumulate).backward()
            total += loss.detach().float()
        dist.all_reduce(total)
        return total / (world * accumulate)

    def full(tensors):
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in tensors.items()}

    def clip_fn():
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    names = {id(p): n for n, p in model.named_parameters()}
    return _train(step, lambda: full(model.state_dict()),
                  lambda: full({names[id(p)]: p.grad for p in model.parameters() if p.grad is not None}),
                  opt, steps, micro, clip_fn if clip is not None else None)


def _split_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``F.linear`` with the weight in 2 x 2 blocks: input halves' partial products summed, output halves
    concatenated (a dimension of 1 is not split)."""
    w = self.weight
    hi, ho = w.shape[1] // 2, w.shape[0] // 2
    if hi == 0:
        return F.linear(x, w, self.bias)
    rows = [slice(0, ho), slice(ho, None)] if ho else [slice(None)]
    out = torch.cat([x[..., :hi] @ w[r, :hi].T + x[..., hi:] @ w[r, hi:].T for r in rows], dim=-1)
    return out + self.bias if self.bias is not None else out


@contextlib.contextmanager
def _linear_split():
    forward = nn.Linear.forward
    nn.Linear.forward = _split_linear
    try:
        yield
    finally:
        nn.Linear.forward = forward


def split_linear_run(*args, **kwargs):
    """``oracle.reference_run`` with every ``nn.Linear`` summed as a Megatron split would (module docstring)."""
    with _linear_split():
        return reference_run(*args, **kwargs)
