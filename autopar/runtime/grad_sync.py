"""Data-parallel gradient sync.

Gradients of parameters replicated on the data-parallel axes are partial sums (each rank's
loss is its share of the global mean), so they are SUMMED, not averaged. The axes shared by
most parameters go through DDP's bucketed reducer (overlapped with backward) with a sum
hook, optionally compressing to bf16/fp16 on the wire (Horovod-style); any other axis a
parameter needs is all-reduced by a post-accumulate-grad hook.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.runtime.comm import COUNTER


def _sum_hook(group, bucket):
    buf = bucket.buffer()
    COUNTER.record("all_reduce", buf, "dp", "bwd")
    return dist.all_reduce(buf, group=group, async_op=True).get_future().then(lambda f: f.value()[0])


def _compress_hook(dtype):
    def hook(group, bucket):
        buf = bucket.buffer()
        low = buf.to(dtype)
        COUNTER.record("all_reduce", low, "dp", "bwd")
        fut = dist.all_reduce(low, group=group, async_op=True).get_future()

        def back(f):
            buf.copy_(f.value()[0])
            return buf

        return fut.then(back)
    return hook


def wrap_ddp(module: torch.nn.Module, group, ignore: list[str], compression: str | None, bucket_mb: float = 25.0):
    """DDP over ``group`` summing gradients; parameters named in ``ignore`` are left alone."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    DDP._set_params_and_buffers_to_ignore_for_model(module, ignore)
    ddp = DDP(module, process_group=group, forward_sync_buffers=False, bucket_cap_mb=bucket_mb,
              gradient_as_bucket_view=True)
    if compression is None:
        ddp.register_comm_hook(group, _sum_hook)
    else:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[compression]
        ddp.register_comm_hook(group, _compress_hook(dtype))
    return ddp


def add_axis_sync_hooks(param: torch.nn.Parameter, groups: list) -> None:
    """All-reduce (sum) this parameter's gradient over ``groups`` once it is accumulated."""
    def hook(p):
        for g in groups:
            COUNTER.record("all_reduce", p.grad, "grad", "bwd")
            dist.all_reduce(p.grad, group=g)
    param.register_post_accumulate_grad_hook(hook)
