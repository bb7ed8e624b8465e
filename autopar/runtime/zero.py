"""ZeRO stages 1, 2 and 3 on the data-parallel axes of a per-rank program (``plan.memory_options.zero``).

A parameter's data-parallel axes are the axes its gradient is summed over (``ParamDecision.grad_sync``):
every rank of that axis set holds the same piece of it, so the set can share the work of updating it.

Layout (FSDP2's, per parameter): the working piece (what the program computes with) is flattened,
zero-padded to a multiple of ``d`` (the size of the axis set) and cut into ``d`` equal chunks of
``c = ceil(n / d)`` elements; rank ``i`` of the set owns chunk ``i`` as a 1-D ``nn.Parameter``, the
*shard*, registered under the parameter's own name. ``pmodel.parameters()`` yields the shards (and
the parameters that have no data-parallel axis), so an optimizer built on them holds 1/d of the state.

One step, for the parameters of one axis set, in buckets of ``bucket_mb`` (same order on every rank;
stage 2 also cuts a bucket at each layer, ``gather_unit``):

* backward leaves each rank's *local* (partial) gradient on the working parameters — no DDP;
* one reduce-scatter per bucket sums the working gradients over the set and leaves each rank its
  chunk, added to the shard's ``.grad``. The input is the ``(d, C)`` matrix whose column block
  ``j`` is parameter ``j``'s padded gradient viewed ``(d, c_j)``, so row ``i`` (rank ``i``'s output)
  is the concatenation of its chunks; the gradients are copied into it once (the padding stays 0).
  Stage 1 runs it after a synced backward (not inside ``no_sync``) and keeps full-size working
  gradient buffers (as DeepSpeed's stage 1): the sum is written into this rank's chunk of it, the
  rest zeroed, and the shard's ``.grad`` is a view of that chunk (no extra bytes; a shard reaching
  into the padding keeps its own gradient). Stage 2 runs it *during* every backward, ``no_sync``
  or not (DeepSpeed's stage 2, FSDP2's reduce-scatter per module): a bucket goes as soon as its
  last gradient is accumulated (``register_post_accumulate_grad_hook``) and its working gradients
  are freed as they are copied in, so no more than a layer's gradients exist whole at a time
  (a bucket a parameter left unused goes after backward, with zeros);
* the optimizer steps on the shards; a global optimizer step post-hook all-gathers the updated
  shards (``(C,)`` → ``(d, C)``) back into the working parameters.

Gradient accumulation is exact without setting anything aside: stage 1's local gradients of
``no_sync`` steps add up in the working gradients and the next synced step (or ``flush``, run by the
optimizer step pre-hook, ``clip_grad_norm_`` and ``full_grad_dict``) reduce-scatters their sum;
stage 2 reduce-scatters each microbatch (k collectives for k microbatches, priced so); sums of
earlier reduce-scatters add up in the shards' gradients. Communication per step equals DDP's
all-reduce (reduce-scatter + all-gather, the ZeRO paper's 2Ψ); ``cost_models/zero.py`` prices it.

ZeRO-3 runs in ``runtime/zero3.py``; ZeRO-1 with a pipeline in ``runtime/pipeline_zero.py`` (ZeRO-2 and 3
with a pipeline are refused: ``check_zero_supported``).
"""
from __future__ import annotations

import contextlib
import math
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from autopar.collectives.comm import COUNTER
from autopar.collectives.groups import span_group
from autopar.collectives.watch import guard
from autopar.core.comm_timeout import comm_timeout_s
from autopar.cost_models.zero import PIPELINE_ZERO, ZERO_BUCKET_MB, gather_unit
from autopar.plan.plan import PlanError
from autopar.runtime.program import _owner

BUCKET_MB = ZERO_BUCKET_MB


def check_zero_supported(plan, pipelined: bool) -> None:
    """Raise a PlanError for a ZeRO stage this runtime cannot run (2 or 3 with a pipeline:
    ``runtime/pipeline_zero.py`` runs stage 1; ZeRO-3 compiled: its gathers and saved-tensor hooks
    do not trace, and compiled it trains wrong)."""
    zero = plan.memory_options.zero
    if pipelined and zero not in PIPELINE_ZERO:
        raise PlanError(f"memory_options.zero={zero} is not supported with a pipeline (pp > 1): ZeRO-2 and 3 would "
                        "reduce-scatter or gather every microbatch; use zero=1 (optimizer state sharded over the "
                        "data-parallel ranks) or zero=0 for pipelined plans")
    if zero == 3 and plan.compiled:
        raise PlanError("the plan has memory_options.zero=3 and compiled=True: ZeRO-3 does not run compiled yet "
                        "(its per-layer gathers and saved-tensor hooks do not trace); make the plan with zero=0, 1 "
                        "or 2, or with compile=False")


def axes_group(axes: tuple[str, ...], groups: dict, mesh):
    """The process group spanning the mesh axes ``axes`` (``groups``: axis -> AxisGroup)."""
    if len(axes) == 1:
        return groups[axes[0]].group
    return span_group(mesh, axes)


class _Sharded:
    """One parameter: its working piece, this rank's shard, its element count and chunk size."""

    def __init__(self, name: str, working: nn.Parameter, d: int, index: int):
        self.name, self.working = name, working
        self.n, self.shape = working.numel(), working.shape
        self.c = math.ceil(self.n / d) if self.n else 0
        lo, hi = self.lo, self.hi = index * self.c, (index + 1) * self.c
        # a chunk inside the parameter is a view of it (no copy; the optimizer updates it in place);
        # only a chunk reaching into the padding is a copy
        self.aliased = hi <= self.n and working.is_contiguous()
        if self.aliased:
            piece = working.detach().view(-1)[lo:hi]
        else:
            piece = F.pad(working.detach().reshape(-1), (0, self.c * d - self.n))[lo:hi].clone()
        self.shard = nn.Parameter(piece, requires_grad=working.requires_grad)


class _AxisSet:
    """The parameters sharded over one set of axes, in name order, cut into buckets."""

    def __init__(self, axes: tuple[str, ...], group, label: str, params: list[tuple[str, nn.Parameter]],
                 bucket_mb: float, per_layer: bool = False):
        self.axes, self.group, self.label = axes, group, label
        self.d = dist.get_world_size(group)
        self.index = dist.get_rank(group)
        self.params = [_Sharded(n, p, self.d, self.index) for n, p in params]
        self.buckets: list[list[_Sharded]] = []
        size = 0
        for sp in self.params:
            nbytes = sp.c * self.d * sp.working.element_size()
            if not self.buckets or size + nbytes > bucket_mb * 2 ** 20 or \
                    sp.working.dtype != self.buckets[-1][0].working.dtype or \
                    per_layer and gather_unit(sp.name) != gather_unit(self.buckets[-1][0].name):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(sp)
            size += nbytes


def write_rows(inp: torch.Tensor, at: int, grad: torch.Tensor, sp) -> None:
    """Write ``grad`` (``sp.n`` elements) into columns ``[at, at + sp.c)`` of the reduce-scatter input
    ``inp`` of shape (d, C): row r holds elements [r c, (r + 1) c), the last row's tail stays zero."""
    flat = grad.detach().reshape(-1)
    full, rest = divmod(sp.n, sp.c) if sp.c else (0, 0)
    if full:
        inp[:full, at:at + sp.c].copy_(flat[:full * sp.c].view(full, sp.c))
    if rest:
        inp[full, at:at + rest].copy_(flat[full * sp.c:])


class ZeroSync:
    """ZeRO-1/2 gradient sync and parameter update of one per-rank program (module docstring).

    Duck-types ``runtime.grad_sync.Accumulation`` (``no_sync``, ``before_backward``,
    ``after_backward``, ``flush``, ``syncing``) so ``ParallelModule.step`` drives it unchanged.
    ``sync``: parameter name -> its data-parallel axes (mesh order); ``groups``: axis -> AxisGroup."""

    def __init__(self, program: nn.Module, sync: dict[str, tuple], groups: dict, mesh, stage: int,
                 compression: str | None = None, bucket_mb: float = BUCKET_MB):
        if stage not in (1, 2):
            raise PlanError(f"ZeroSync runs ZeRO stages 1 and 2, not {stage}")
        self.stage = stage
        self._wire = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(compression)
        named = dict(program.named_parameters())
        by_axes: dict[tuple, list] = {}
        for name in sorted(sync):                   # sorted: the same order on every rank
            p, axes = named.get(name), tuple(sync[name])
            if p is not None and axes and p.requires_grad:
                by_axes.setdefault(axes, []).append((name, p))
        order = sorted(by_axes, key=lambda ax: [mesh.axis_names.index(a) for a in ax])
        self.sets = [_AxisSet(ax, axes_group(ax, groups, mesh), "+".join(ax), by_axes[ax], bucket_mb,
                              per_layer=stage == 2) for ax in order]
        self.sharded = {sp.name: (s, sp) for s in self.sets for sp in s.params}
        self._pending: dict[int, int] = {}      # stage 2: id(bucket) -> gradients still to come this backward
        if stage == 2:
            for s in self.sets:
                for bucket in s.buckets:
                    for sp in bucket:
                        sp.working.register_post_accumulate_grad_hook(self._ready_hook(s, bucket))
        self._shard_ids = {id(sp.shard) for _, sp in self.sharded.values()}
        # what pmodel.parameters() yields: shards under the parameters' names, other parameters as they are
        self.params = nn.Module()
        for name, p in named.items():
            mod, leaf = _owner(self.params, name)
            mod.register_parameter(leaf, self.sharded[name][1].shard if name in self.sharded else p)
        self.syncing = True
        self.local = False          # working gradients hold local parts of no_sync steps
        self.timeout_s = comm_timeout_s()       # its groups' timeout, named when a peer fails in opt.step()
        _LIVE.add(self)

    # ---- Accumulation's interface ---------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        before, self.syncing = self.syncing, False      # nests (plan-level accumulation inside the user's)
        try:
            yield
        finally:
            self.syncing = before

    def before_backward(self) -> None:
        """Gradients the user zeroed (``opt.zero_grad()``, shard ``.grad`` None) since the last
        backward discard what the working gradients still hold of them. Stage 1: a shard's gradient
        views its chunk of the working gradient (zeroed, kept allocated). Stage 2: every bucket
        waits for all its gradients again."""
        if self.stage == 1:
            for _, sp in self.sharded.values():
                if sp.aliased and sp.shard.grad is None and sp.working.grad is not None:
                    sp.working.grad.zero_()
                    self.local = False
        else:
            self._pending = {id(b): len(b) for s in self.sets for b in s.buckets}

    def after_backward(self) -> None:
        if self.stage == 2:
            # the buckets whose gradients all came were reduce-scattered during backward; the rest
            # (a parameter this step did not use) go now, with zeros for what did not come
            for s in self.sets:
                for bucket in s.buckets:
                    if self._pending.get(id(bucket)):
                        self._reduce_scatter_bucket(s, bucket)
            self._pending = {}
        elif self.syncing:
            self.reduce_scatter()
        else:
            self.local = True
            self._view_chunks()

    def _ready_hook(self, s: "_AxisSet", bucket: list):
        """Stage 2: the hook a working parameter runs once its gradient of this backward is
        accumulated; the bucket's last one reduce-scatters the bucket (every backward, ``no_sync``
        or not: the sum is linear, so accumulation stays exact) and frees its working gradients."""
        def hook(_param) -> None:
            left = self._pending.get(id(bucket))
            if left is None:
                return                  # a backward not driven by step() (before_backward not run)
            self._pending[id(bucket)] = left - 1
            if left == 1:
                self._reduce_scatter_bucket(s, bucket)
                self._pending[id(bucket)] = 0
        return hook

    def _view_chunks(self) -> None:
        """Stage 1: each aliased shard's gradient is its chunk of the working gradient."""
        if self.stage != 1:
            return
        for _, sp in self.sharded.values():
            if sp.aliased and sp.working.grad is not None:
                sp.shard.grad = sp.working.grad.view(-1)[sp.lo:sp.hi]

    def flush(self) -> None:
        if self.local:
            self.reduce_scatter()

    def owns_any(self, tensors) -> bool:
        return any(id(t) in self._shard_ids for t in tensors)

    # ---- collectives ------------------------------------------------------------------------------
    def reduce_scatter(self) -> None:
        """Sum the working gradients over each axis set; each rank adds its chunk to its shard's grad."""
        for s in self.sets:
            for bucket in s.buckets:
                self._reduce_scatter_bucket(s, bucket)
        self.local = False

    def _reduce_scatter_bucket(self, s: _AxisSet, bucket: list[_Sharded]) -> None:
        width = sum(sp.c for sp in bucket)
        inp = bucket[0].working.new_zeros(s.d, width)       # one copy of the bucket: the padding stays 0
        at = 0
        for sp in bucket:
            g = sp.working.grad
            if g is not None:
                write_rows(inp, at, g, sp)
                if self.stage >= 2:
                    sp.working.grad = None          # its bytes are in the bucket now
            at += sp.c
        inp = inp.view(-1)
        dtype = inp.dtype
        if self._wire is not None:
            inp = inp.to(self._wire)
        out = inp.new_empty(inp.numel() // s.d)
        COUNTER.record("reduce_scatter", inp, s.label, "bwd")
        dist.reduce_scatter_single(out, inp, group=s.group)
        out = out.to(dtype)
        for sp, piece in zip(bucket, out.split([sp.c for sp in bucket])):
            sh = sp.shard
            if self.stage == 1 and sp.aliased:
                # the working gradient keeps the sum in this rank's chunk (which the next
                # reduce-scatter adds in again: accumulation) and zeros elsewhere
                wg = sp.working.grad
                if wg is None:
                    wg = sp.working.grad = torch.zeros_like(sp.working)
                wg.zero_()
                sh.grad = wg.view(-1)[sp.lo:sp.hi]
                sh.grad.copy_(piece)
                continue
            sh.grad = piece if sh.grad is None else sh.grad.add_(piece)
            if self.stage >= 2:
                sp.working.grad = None
            elif sp.working.grad is not None:
                sp.working.grad.zero_()

    @torch.no_grad()
    def all_gather(self) -> None:
        """Copy every rank's updated shard back into the working parameters."""
        for s in self.sets:
            for bucket in s.buckets:
                inp = torch.cat([sp.shard.detach().reshape(-1) for sp in bucket])
                out = inp.new_empty(inp.numel() * s.d)
                COUNTER.record("all_gather", inp, s.label, "step", parts=s.d)
                dist.all_gather_single(out, inp, group=s.group)
                for sp, cols in zip(bucket, out.view(s.d, -1).split([sp.c for sp in bucket], dim=1)):
                    sp.working.copy_(cols.reshape(-1)[:sp.n].view_as(sp.working))

    @torch.no_grad()
    def refresh_shards(self) -> None:
        """Re-cut the shards from the working parameters (after loading a state dict)."""
        for s in self.sets:
            for sp in s.params:
                if sp.aliased:
                    continue
                flat = F.pad(sp.working.reshape(-1), (0, sp.c * s.d - sp.n))
                sp.shard.copy_(flat[s.index * sp.c:(s.index + 1) * sp.c])

    # ---- gradients as ParallelModule reads them -------------------------------------------------
    def handles(self, name: str) -> bool:
        return name in self.sharded

    def working(self, name: str) -> torch.Tensor:
        return self.sharded[name][1].working

    @torch.no_grad()
    def load_piece(self, name: str, piece: torch.Tensor) -> None:
        self.sharded[name][1].working.copy_(piece)

    def grad_pieces(self, program: nn.Module, replicas) -> list[tuple[torch.Tensor, float]]:
        """(gradient, how many ranks hold that same piece) for every gradient this rank holds:
        a shard's piece is held by ``replicas(name) / d`` ranks."""
        out = []
        for name, p in program.named_parameters():
            if name in self.sharded:
                s, sp = self.sharded[name]
                if sp.shard.grad is not None:
                    out.append((sp.shard.grad, replicas(name) / s.d))
            elif p.grad is not None:
                out.append((p.grad, replicas(name)))
        return out

    def local_grad(self, name: str) -> torch.Tensor:
        """This rank's working-shape gradient of ``name`` (all-gathered over its axis set; zeros where none)."""
        s, sp = self.sharded[name]
        g = sp.shard.grad if sp.shard.grad is not None else torch.zeros_like(sp.shard)
        out = g.new_empty(sp.c * s.d)
        dist.all_gather_single(out, g.detach().contiguous(), group=s.group)
        return out[:sp.n].view(sp.shape).clone()

    def held_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now: parameters (working + shards), gradients (working + shards)."""
        params = grads = 0
        seen = set()
        aliased = {id(sp.shard) for _, sp in self.sharded.values() if sp.aliased}
        grad_views = aliased if self.stage == 1 else set()    # stage 1: chunks of the working gradients
        for t in [*(sp.working for _, sp in self.sharded.values()), *self.params.parameters()]:
            if id(t) in seen:
                continue
            seen.add(id(t))
            if id(t) not in aliased:        # a shard that views its working parameter adds no bytes
                params += t.numel() * t.element_size()
            if t.grad is not None and id(t) not in grad_views:
                grads += t.grad.numel() * t.grad.element_size()
        return {"params": params, "grads": grads}


_LIVE: "weakref.WeakSet[ZeroSync]" = weakref.WeakSet()


def _params_of(optimizer):
    return [p for g in optimizer.param_groups for p in g["params"]]


def _flush_before_step(optimizer, args, kwargs) -> None:
    for z in list(_LIVE):
        if z.local and z.owns_any(_params_of(optimizer)):
            with guard("optimizer.step (ZeRO: summing the gradients of no_sync steps)", z.timeout_s):
                z.flush()


def _gather_after_step(optimizer, args, kwargs) -> None:
    for z in list(_LIVE):
        if z.owns_any(_params_of(optimizer)):
            with guard("optimizer.step (ZeRO: all-gathering the updated parameters)", z.timeout_s):
                z.all_gather()


register_optimizer_step_pre_hook(_flush_before_step)
register_optimizer_step_post_hook(_gather_after_step)
