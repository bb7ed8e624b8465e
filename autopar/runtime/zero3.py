"""ZeRO-3 on the data-parallel axes of a per-rank program (``plan.memory_options.zero == 3``); the
shard layout is ZeRO-1/2's (``runtime/zero.py``: ``_Sharded``, FSDP2's per-parameter chunks).

ZeRO-3 (``Zero3``): the program's parameters *are* the shards. A graph pass puts a ``Zero3Gather``
module before the first use of each layer's parameters (a layer: the name up to its first numeric
part, "blocks.0"; else the owner module), which all-gathers them in one collective; the gathered
tensors die after their last forward use, because tensors autograd saves from them are packed as
tokens (saved-tensor hooks) and re-gathered in backward, once per layer (kept until that layer's
gather backward, when every use is done; the same order on every rank, so the collectives match).
The gather's backward reduce-scatters the layer's gradients into the shards' ``.grad``. Every
backward reduce-scatters (``no_sync`` has nothing to hold back: the sum is linear, accumulation stays
exact). Each layer's forward gather starts the next layer's (async, waited for at its use).
Not done yet: prefetching in backward (re-gathers run when first unpacked), and tensors
derived from a gathered parameter by a non-view op (a cast, ``contiguous``) stay saved in full.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from autopar.collectives.comm import COUNTER
from autopar.cost_models.zero import gather_unit
from autopar.runtime.zero import ZeroSync, _Sharded, axes_group, write_rows


class Zero3Gather(nn.Module):
    """One layer's parameters over one axis set: ``forward(*shards)`` all-gathers them (one
    collective) into their working shapes; their gradients are reduce-scattered back to the shards
    in backward. Tensors autograd saves from the gathered parameters are packed as tokens
    (``Zero3.pack``) and re-gathered in backward, once per layer: the gathered copy is kept from the
    first unpack to this gather's backward (when every use's backward has run), then dropped."""

    def __init__(self, names: list[str], label: str):
        super().__init__()
        self.names, self.label = list(names), label
        self.group = None
        self.d = 1
        self.items: list[_Sharded] = []      # filled by Zero3.bind
        self.live: dict[int, int] = {}       # id(gathered tensor) -> index, this forward
        self.cache: list[torch.Tensor] | None = None
        self.pending = None                  # (work, output, input) of a prefetched forward gather
        self.compute_dtype = None            # mixed precision: the masters are cast to it here (``Zero3.bind``)
        object.__setattr__(self, "next", None)      # the layer gathered after this one (prefetch)
        object.__setattr__(self, "first", None)     # on the first layer: all layers (reset per forward)

    def _start(self, shards, phase: str, async_op: bool):
        inp = torch.cat([s.detach().reshape(-1) for s in shards])
        out = inp.new_empty(inp.numel() * self.d)
        COUNTER.record("all_gather", inp, self.label, phase, parts=self.d)
        work = dist.all_gather_single(out, inp, group=self.group, async_op=async_op)
        return work, out, inp

    def gather(self, shards, phase: str) -> list[torch.Tensor]:
        if phase == "fwd" and self.pending is not None:     # prefetched while the layer before ran
            work, out, _ = self.pending
            self.pending = None
            work.wait()
        else:
            _, out, _ = self._start(shards, phase, async_op=False)
        cols = out.view(self.d, -1).split([sp.c for sp in self.items], dim=1)
        return [c.reshape(-1)[:sp.n].view(sp.shape).clone() for c, sp in zip(cols, self.items)]

    def prefetch(self, dtype) -> None:
        """Start this layer's forward all-gather now (the shards in the compute dtype, as the
        program's cast makes them); its forward waits for it."""
        self.pending = self._start([sp.shard.to(dtype) for sp in self.items], "fwd", async_op=True)

    def forward(self, *shards):
        self.dtype = self.compute_dtype or shards[0].dtype      # the masters' shards are cast to it here
        if self.first is not None:              # a new forward: settle what an aborted one left
            for m in self.first:
                if m.pending is not None:
                    m.pending[0].wait()
                    m.pending = None
        outs = _Zero3GatherFn.apply(self, *shards)
        if self.next is not None:
            self.next.prefetch(self.dtype)
        self.live = {id(t): (i, weakref.ref(t)) for i, t in enumerate(outs)}
        return outs


class _Zero3GatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mod: Zero3Gather, *shards):
        ctx.mod = mod
        ctx.shard_meta = [(s.shape, s.dtype, s.device) for s in shards]
        return tuple(mod.gather([s.to(mod.dtype) for s in shards], "fwd"))

    @staticmethod
    def backward(ctx, *grads):
        mod = ctx.mod
        mod.cache = None                            # every use of this layer's parameters is done
        # the (d, C) input, column block j parameter j's padded gradient viewed (d, c_j), written in
        # place (no padded copy per gradient, no concatenation): reduced in the shards' (master)
        # dtype, which this Function receives uncast (``ParamTree.feed_masters``), so under bf16
        # mixed precision the bf16 weights' gradients are summed in fp32 and reach the masters in
        # fp32, as the plan's reduce_dtype says (FSDP2's reduce_dtype=float32)
        dtype, device = ctx.shard_meta[0][1], ctx.shard_meta[0][2]
        for _, dt, _ in ctx.shard_meta[1:]:
            dtype = torch.promote_types(dtype, dt)
        inp = torch.zeros(mod.d, sum(sp.c for sp in mod.items), dtype=dtype, device=device)
        at = 0
        for g, sp in zip(grads, mod.items):
            if g is not None:
                write_rows(inp, at, g, sp)
            at += sp.c
        inp = inp.view(-1)
        out = inp.new_empty(inp.numel() // mod.d)
        COUNTER.record("reduce_scatter", inp, mod.label, "bwd")
        dist.reduce_scatter_single(out, inp, group=mod.group)
        pieces = out.split([sp.c for sp in mod.items])
        return (None, *(p if p.dtype == dt else p.to(dt) for p, (_, dt, _) in zip(pieces, ctx.shard_meta)))


class Zero3:
    """ZeRO-3 of one per-rank program: ``insert`` puts a ``Zero3Gather`` before each layer's first
    use of its parameters in the graph (the parameters' placeholders then receive this rank's
    shards), ``shard`` replaces the working pieces by the shards before the program is built, and
    ``saving`` packs saved gathered tensors as tokens. No ``no_sync`` saving: each backward
    reduce-scatters (sums are linear, so accumulation stays exact)."""

    stage = 3

    def __init__(self, sync: dict[str, tuple], groups: dict, mesh):
        self._groups, self._mesh = groups, mesh
        self.sync = {n: tuple(a) for n, a in sync.items() if a}
        self.mods: list[Zero3Gather] = []
        self.syncing, self.local = True, False
        self.sets: list = []
        self.sharded: dict = {}
        self._outer = None          # the saved-tensor hooks around the step (``saving``)

    def insert(self, gm, name_of_placeholder: dict[str, str]) -> None:
        import operator

        nodes = list(gm.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        units: dict[tuple, list] = {}
        for node in nodes:
            name = name_of_placeholder.get(node.name) if node.op == "placeholder" else None
            if name in self.sync and node.users:
                units.setdefault((self.sync[name], gather_unit(name)), []).append(node)
        order = sorted(units, key=lambda k: min(pos[u] for ph in units[k] for u in ph.users))
        for k, key in enumerate(order):
            phs = sorted(units[key], key=lambda ph: name_of_placeholder[ph.name])
            first = min((u for ph in phs for u in ph.users), key=pos.get)
            axes = key[0]
            mod = Zero3Gather([name_of_placeholder[ph.name] for ph in phs], "+".join(axes))
            mod.group = axes_group(axes, self._groups, self._mesh)
            mod.d = dist.get_world_size(mod.group)
            target = f"zero3_gather_{k}"
            gm.add_submodule(target, mod)
            with gm.graph.inserting_before(first):
                call = gm.graph.call_module(target, tuple(phs))
                for i, ph in enumerate(phs):
                    item = gm.graph.call_function(operator.getitem, (call, i))
                    ph.replace_all_uses_with(item, delete_user_cb=lambda u: u is not call)
            self.mods.append(mod)
        for a, b in zip(self.mods, self.mods[1:]):
            object.__setattr__(a, "next", b)
        if self.mods:
            object.__setattr__(self.mods[0], "first", list(self.mods))
        gm.recompile()

    def shard(self, params: dict[str, torch.Tensor]) -> None:
        """Replace the working pieces in ``params`` (name -> tensor) by this rank's shards."""
        for mod in self.mods:
            index = dist.get_rank(mod.group)
            for name in mod.names:
                sp = _Sharded(name, nn.Parameter(params[name], requires_grad=params[name].requires_grad),
                              mod.d, index)
                sp.shape = params[name].shape
                if sp.aliased:
                    sp.shard = nn.Parameter(sp.shard.detach().clone(), requires_grad=sp.shard.requires_grad)
                sp.aliased = False
                params[name] = sp.shard.detach().requires_grad_(sp.shard.requires_grad)
                mod.items.append(sp)

    def bind(self, program: nn.Module) -> None:
        """After the program registered the shards: point the records at its parameters."""
        self.params = program
        for mod in self.mods:
            mod.compute_dtype = program.feed_masters(mod.names)
            s = _SetView(mod)
            for sp in mod.items:
                sp.shard = program.local_tensor(sp.name)
                sp.working = None
                self.sharded[sp.name] = (s, sp)
        self._ids = {id(sp.shard) for _, sp in self.sharded.values()}

    # ---- saved tensors: tokens instead of gathered parameters -------------------------------------
    def saving(self):
        """Saved-tensor hooks that keep gathered weights as tokens; other tensors go through the
        hooks active around the step (a user's offloading, a memory meter) as if these were absent."""
        self._outer = torch._C._autograd._top_saved_tensors_default_hooks(True)
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t):
        base = t._base if t._base is not None else t
        for mod in self.mods:
            hit = mod.live.get(id(base))
            if hit is not None and hit[1]() is base:
                i = hit[0]
                return ("zero3", mod, i, t.size(), t.stride(), t.storage_offset() - base.storage_offset())
        return t if self._outer is None else ("outer", self._outer[1], self._outer[0](t))

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, tuple) and len(packed) == 3 and packed[0] == "outer":
            return packed[1](packed[2])
        if not (isinstance(packed, tuple) and len(packed) == 6 and packed[0] == "zero3"):
            return packed
        _, mod, i, size, stride, offset = packed
        if mod.cache is None:
            mod.cache = mod.gather([sp.shard.to(mod.dtype) for sp in mod.items], "bwd")
        full = mod.cache[i]
        return full.as_strided(size, stride, full.storage_offset() + offset)

    # ---- Accumulation's interface (nothing is held back) --------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        yield

    def before_backward(self) -> None:
        pass

    def after_backward(self) -> None:
        for mod in self.mods:
            mod.live = {}

    def flush(self) -> None:
        pass

    def owns_any(self, tensors) -> bool:
        return False

    def handles(self, name: str) -> bool:
        return name in self.sharded

    grad_pieces = ZeroSync.grad_pieces
    local_grad = ZeroSync.local_grad

    def working(self, name: str) -> torch.Tensor:
        """This rank's working-shape piece of ``name`` (all-gathered over its axis set)."""
        s, sp = self.sharded[name]
        out = sp.shard.new_empty(sp.c * s.d)
        dist.all_gather_single(out, sp.shard.detach().contiguous(), group=s.group)
        return out[:sp.n].view(sp.shape).clone()

    @torch.no_grad()
    def load_piece(self, name: str, piece: torch.Tensor) -> None:
        s, sp = self.sharded[name]
        flat = F.pad(piece.reshape(-1).to(sp.shard.dtype), (0, sp.c * s.d - sp.n))
        sp.shard.copy_(flat[s.index * sp.c:(s.index + 1) * sp.c])

    def refresh_shards(self) -> None:
        pass

    def held_bytes(self) -> dict[str, int]:
        params = grads = 0
        for p in self.params.parameters():
            params += p.numel() * p.element_size()
            if p.grad is not None:
                grads += p.grad.numel() * p.grad.element_size()
        return {"params": params, "grads": grads}


class _SetView:
    """What ZeroSync's gradient readers need of an axis set: its group, size and this rank's index."""

    def __init__(self, mod: Zero3Gather):
        self.group, self.d = mod.group, mod.d
        self.index = dist.get_rank(mod.group)


class Zero3Runner(nn.Module):
    """What ``ParallelModule.step`` calls under ZeRO-3: the program, with saved gathered parameters
    packed as tokens (``Zero3.saving``)."""

    def __init__(self, program: nn.Module, zero3: Zero3):
        super().__init__()
        self.program = program
        object.__setattr__(self, "_z3", zero3)

    def forward(self, *inputs, **kwargs):
        with self._z3.saving():
            return self.program(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        yield
