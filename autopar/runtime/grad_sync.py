"""Data-parallel gradient sync.

Gradients of parameters replicated on the data-parallel axes are partial sums (each rank's
loss is its share of the global mean), so they are SUMMED, not averaged. Which parameters are
summed over which axes is decided once, at plan time (``sharding/grad_sync.py``). The axes shared
by most parameters go through DDP's bucketed reducer (overlapped with backward) with a sum
hook, optionally compressing to bf16/fp16 on the wire (Horovod-style); any other axis a
parameter needs is all-reduced by a post-accumulate-grad hook.

Accumulation (``Accumulation``): several steps before the optimizer's step add up exactly like
several ``loss.backward()`` calls on one device. A sum is only right over the gradient one step
produced, so each synced step sets the gradients earlier steps already summed aside and adds them
back after its own sum. Steps inside ``no_sync()`` keep their local partial gradients; the next
synced step sums them with its own, and so does ``flush()``, which runs before any optimizer's
step, before ``clip_grad_norm_`` and before gradients are gathered.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autopar.collectives.comm import COUNTER
from autopar.collectives.groups import group_name, span_group
from autopar.collectives.watch import guard, note
from autopar.core.comm_timeout import comm_timeout_s, world_group


def _sum_hook(group, bucket):
    buf = bucket.buffer()
    COUNTER.record("all_reduce", buf, group_name(group, "dp"), "bwd")
    return dist.all_reduce(buf, group=group, async_op=True).get_future().then(lambda f: f.value()[0])


def _compress_hook(dtype):
    def hook(group, bucket):
        buf = bucket.buffer()
        low = buf.to(dtype)
        COUNTER.record("all_reduce", low, group_name(group, "dp"), "bwd")
        fut = dist.all_reduce(low, group=group, async_op=True).get_future()

        def back(f):
            buf.copy_(f.value()[0])
            return buf

        return fut.then(back)
    return hook


class _SyncedFirst(torch.nn.Module):
    """What DDP wraps: ``program``, with the parameters DDP sums registered here too, last first
    (DDP's own guess at the order their gradients become ready), so that DDP lists them in that order."""

    def __init__(self, program: torch.nn.Module, synced: list[tuple[str, torch.nn.Parameter]]):
        super().__init__()
        self.program = program
        for name, p in reversed(synced):
            self.register_parameter(name.replace(".", "__"), p)

    def forward(self, *args, **kwargs):
        return self.program(*args, **kwargs)


def wrap_ddp(module: torch.nn.Module, group, ignore: list[str], compression: str | None, bucket_mb: float = 25.0):
    """DDP over ``group`` summing gradients; parameters named in ``ignore`` are left alone.

    Its buckets are fixed before the first step (in the parameters' reverse order), not rebuilt
    after it in the order the first backward made the gradients ready, which is what DDP does by
    default: where a gradient lies in a bucket decides the order its ranks' parts are summed in
    (over more than 2 ranks), so a module built to resume from a checkpoint would otherwise sum its
    first step in another order than the run that saved it, and not train on bit for bit."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    skip = set(ignore)
    synced = [(n, p) for n, p in module.named_parameters() if n not in skip and p.requires_grad]
    wrapper = _SyncedFirst(module, synced)
    DDP._set_params_and_buffers_to_ignore_for_model(wrapper, [f"program.{n}" for n in ignore])
    ddp = DDP(wrapper, process_group=group, forward_sync_buffers=False, bucket_cap_mb=bucket_mb,
              gradient_as_bucket_view=True)
    ddp.reducer._push_all_rebuilt_params()      # the first forward builds the buckets in that order, once
    if compression is None:
        ddp.register_comm_hook(group, _sum_hook)
    else:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[compression]
        ddp.register_comm_hook(group, _compress_hook(dtype))
    return ddp


def add_axis_sync_hooks(param: torch.nn.Parameter, groups: list, acc: "Accumulation") -> None:
    """All-reduce (sum) this parameter's gradient over ``groups`` once it is accumulated (not
    inside ``acc.no_sync()``)."""
    def hook(p):
        if not acc.syncing:
            return
        for g in groups:
            COUNTER.record("all_reduce", p.grad, group_name(g, "grad"), "bwd")
            dist.all_reduce(p.grad, group=g)
    param.register_post_accumulate_grad_hook(hook)


def sum_grads(grads_by_axes: dict[tuple, list[torch.Tensor]], groups: dict) -> None:
    """Sum gradients over their axes, one flat buffer per axis set (``groups``: axis -> group)."""
    for axes, grads in grads_by_axes.items():
        if not grads or not axes:
            continue
        flat = _flatten_dense_tensors(grads)
        for a in axes:
            COUNTER.record("all_reduce", flat, a, "bwd")
            dist.all_reduce(flat, group=groups[a])
        for g, new in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(new)


def broadcast_state(model: torch.nn.Module, bucket_mb: float = 25.0) -> None:
    """Give every rank rank 0's parameters and buffers (in place), as DDP does for its replicas:
    ranks whose models were initialised differently (no common seed) then train one model."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in [*model.parameters(), *model.buffers()]:      # parameters() already skips tied copies
        nbytes = t.numel() * t.element_size()
        if not buckets or size + nbytes > bucket_mb * 2 ** 20 or t.dtype != buckets[-1][0].dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    for bucket in buckets:
        flat = _flatten_dense_tensors([b.detach() for b in bucket])
        note("broadcast", detail="of rank 0's parameters and buffers")
        dist.broadcast(flat, src=0, group=world_group())
        with torch.no_grad():
            for b, new in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                b.copy_(new)


def grads_by_axes(params: dict[str, torch.nn.Parameter], sync: dict[str, tuple]) -> dict[tuple, list]:
    """The gradients to sum, grouped by their sync axes (``sync``: parameter name -> axes), in
    name order: every rank must flatten the same tensors in the same order."""
    out: dict[tuple, list] = {}
    for name, axes in sorted(sync.items()):
        p = params.get(name)
        if p is not None and p.grad is not None and axes:
            out.setdefault(tuple(axes), []).append(p.grad)
    return out


_PENDING: "weakref.WeakSet[Accumulation]" = weakref.WeakSet()


class Accumulation:
    """Gradient accumulation over several steps of one per-rank module (module docstring).

    ``params``: the trainable parameters; ``flush_sum``: sums their current local gradients over
    their axes (the same sums a synced step runs)."""

    def __init__(self, params: list[torch.nn.Parameter], flush_sum):
        self._params = [p for p in params if p.requires_grad]
        self._ids = {id(p) for p in self._params}
        self._flush_sum = flush_sum
        self._held: dict[int, torch.Tensor] = {}
        self.local = False      # gradients hold local (unsummed) parts from no_sync steps
        self.syncing = True
        self.timeout_s = comm_timeout_s()       # its groups' timeout, named when a peer fails in opt.step()

    @contextlib.contextmanager
    def no_sync(self):
        before, self.syncing = self.syncing, False
        try:
            yield
        finally:
            self.syncing = before

    def before_backward(self) -> None:
        """Set the already-summed gradients aside (unless local parts wait to be summed with this step's)."""
        if self.local and all(p.grad is None for p in self._params):
            self._held.clear()          # the user zeroed the gradients meanwhile
            self.local = False
        if self.local:
            return
        for p in self._params:
            if p.grad is not None:
                self._held[id(p)] = p.grad.detach().clone()     # DDP's gradient may be a view of its bucket
                p.grad = None

    def after_backward(self) -> None:
        """After this step's sums (or none inside no_sync): add the set-aside gradients back."""
        if not self.syncing:
            self.local = True
            _PENDING.add(self)
            return
        self._restore()

    def flush(self) -> None:
        """Sum gradients that no_sync steps left local; a no-op otherwise."""
        if not self.local:
            return
        self._flush_sum()
        self._restore()

    def _restore(self) -> None:
        for p in self._params:
            held = self._held.pop(id(p), None)
            if held is not None:
                p.grad = held if p.grad is None else p.grad.add_(held)
        self.local = False
        _PENDING.discard(self)

    def owns_any(self, tensors) -> bool:
        return any(id(t) in self._ids for t in tensors)


def _flush_before_optimizer_step(optimizer, args, kwargs) -> None:
    for acc in list(_PENDING):
        if acc.owns_any(p for g in optimizer.param_groups for p in g["params"]):
            with guard("optimizer.step (summing the gradients of no_sync steps)", acc.timeout_s):
                acc.flush()


register_optimizer_step_pre_hook(_flush_before_optimizer_step)


def setup_grad_sync(program: torch.nn.Module, sync: dict, axes: dict, mesh, acc: Accumulation,
                    compression: str | None = None):
    """Sum each parameter's gradient over its axes (``sync``: name -> axes): DDP's reducer over the
    axis set that holds the most elements, post-accumulate hooks for the others. Returns the DDP
    wrapper (None when nothing is summed through it)."""
    if not dist.is_initialized() or mesh.size == 1:
        return None
    by_name = {name: set(a) for name, a in sync.items()}
    weight: dict[frozenset, int] = {}
    for name, ax in by_name.items():
        weight[frozenset(ax)] = weight.get(frozenset(ax), 0) + program.local_tensor(name).numel()
    main = max(weight, key=weight.get) if weight else frozenset()
    ignore, ddp = [], None
    for name, p in program.named_parameters():
        ax = by_name.get(name, set())
        if not main or not main <= ax:
            ignore.append(name)
            extra = ax
        else:
            extra = ax - main
        if extra:
            add_axis_sync_hooks(p, [axes[a].group for a in sorted(extra, key=mesh.axis_names.index)], acc)
    if main:
        group = axes[next(iter(main))].group if len(main) == 1 else span_group(mesh, main)
        ignore += [name for name, _ in program.named_buffers()]
        ddp = wrap_ddp(program, group, ignore, compression)
    return ddp
