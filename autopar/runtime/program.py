"""RankProgram: one rank's executable graph plus the local pieces of parameters and buffers."""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.collectives.groups import AxisGroup, bound_axes
from autopar.runtime.compiled import runner
from autopar.runtime.materialize import empty_piece
from autopar.sharding.shard_params import local_piece
from autopar.frontend.trace import cast_floating


def _owner(root: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    *path, leaf = dotted.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part) or not isinstance(getattr(mod, part), nn.Module):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    return mod, leaf


def placeholder_slot(ph: str, traced, decisions: dict, named_params: dict, named_buffers: dict, coords, mesh_shape,
                     params: dict, buffers: dict) -> tuple:
    """The program slot of graph input ``ph`` of ``traced``; for a parameter or buffer, this rank's
    piece of the model's tensor (``decisions[ph]`` = (name, ParamDecision)) goes into ``params``/``buffers``."""
    if ph in traced.params or ph in traced.buffers:
        name, d = decisions[ph]
        is_param = ph in traced.params
        full = (named_params if is_param else named_buffers).get(name)
        piece = local_piece(full.detach(), d.spec, coords, mesh_shape)
        piece = empty_piece(piece) if piece.is_meta else piece.clone()   # a meta model: allocated, not filled
        if is_param:
            piece.requires_grad_(full.requires_grad and piece.is_floating_point())
        (params if is_param else buffers)[name] = piece
        return ("param" if is_param else "buffer", name)
    if ph in traced.constants:
        return ("const", traced.constants[ph])
    if ph in traced.inputs:
        return ("input", traced.inputs.index(ph))
    return ("target", None)


def fill_slots(slots, tensor_of, inputs, target) -> list:
    """A graph's arguments, one per placeholder: ("param"|"buffer", name), ("const", tensor),
    ("input", index) or ("target", None)."""
    args = []
    for kind, ref in slots:
        if kind in ("param", "buffer"):
            args.append(tensor_of(ref))
        elif kind == "const":
            args.append(ref)
        elif kind == "input":
            args.append(inputs[ref])
        else:
            args.append(target)
    return args


class ParamTree(nn.Module):
    """This rank's pieces of parameters and buffers, registered under the model's own names; a
    parameter piece keeps the model parameter's ``requires_grad`` (frozen stays frozen).

    With a ``compute_dtype`` (mixed precision) the registered parameters are the fp32 masters and
    the graphs get ``compute_tensor(name)``: a differentiable cast, made once per step (autograd
    returns its gradient to the master in fp32)."""

    def __init__(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                 compute_dtype: torch.dtype | None = None):
        super().__init__()
        self._compute_dtype = compute_dtype
        self._working: dict[str, torch.Tensor] = {}
        self._masters: frozenset[str] = frozenset()     # fed uncast: their consumer casts (``feed_masters``)
        self._param_names = frozenset(params)
        for name, t in params.items():
            mod, leaf = _owner(self, name)
            mod.register_parameter(leaf, nn.Parameter(t, requires_grad=t.requires_grad))
        for name, t in buffers.items():
            mod, leaf = _owner(self, name)
            mod.register_buffer(leaf, t)

    def local_tensor(self, name: str) -> torch.Tensor:
        mod, leaf = _owner(self, name)
        return getattr(mod, leaf)

    def compute_tensor(self, name: str) -> torch.Tensor:
        """What the graphs compute with: the parameter, or its working copy in the compute dtype."""
        t = self.local_tensor(name)
        if self._compute_dtype is None or name not in self._param_names or name in self._masters:
            return t
        if name not in self._working:
            self._working[name] = cast_floating(t, self._compute_dtype)
        return self._working[name]

    def feed_masters(self, names) -> torch.dtype | None:
        """Feed the graphs these parameters' masters uncast (their consumer casts them, so that their
        gradients come back in the masters' dtype: ZeRO-3's gather); returns the compute dtype."""
        self._masters = self._masters | frozenset(names)
        return self._compute_dtype

    def cast_input(self, x):
        return cast_floating(x, self._compute_dtype) if isinstance(x, torch.Tensor) else x

    def new_step(self) -> None:
        """Drop the working copies (the masters may have changed since)."""
        self._working = {}

    def has(self, name: str) -> bool:
        try:
            self.local_tensor(name)
            return True
        except AttributeError:
            return False


class RankProgram(ParamTree):
    """Calls the per-rank graph with this rank's parameters (named like the original model);
    ``compiled``: the graphs run through torch.compile (``runtime/compiled.py``)."""

    def __init__(self, gm: fx.GraphModule, forward_gm: fx.GraphModule, slots: list[tuple[str, object]],
                 params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], axes: dict[str, AxisGroup],
                 compute_dtype: torch.dtype | None = None, compiled: bool = False):
        super().__init__(params, buffers, compute_dtype)
        self._autopar_graph = gm
        self._autopar_forward = forward_gm
        self._runs = {False: runner(gm, compiled), True: runner(forward_gm, compiled)}   # by forward_only
        self._slots = slots          # per placeholder: ("param", name) | ("buffer", name) | ("const", t) | ("input", i) | ("target", None)
        self._axes = axes

    def forward(self, *inputs, target=None, forward_only: bool = False):
        self.new_step()
        args = fill_slots(self._slots, self.compute_tensor, [self.cast_input(x) for x in inputs], target)
        with bound_axes(self._axes):
            return self._runs[forward_only](*args)

    @property
    def gm(self) -> fx.GraphModule:
        return self._autopar_graph
