"""torch.export frontend: one training step's forward (model + loss) as an aten-level fx graph.

The graph is traced on fake tensors (or meta tensors when the model lives on the meta
device), so planning never allocates real weights. Every node keeps ``meta["val"]``
(shape/dtype) and gains ``meta["module_path"]``; parameters/buffers are graph inputs
whose names map back to ``model.state_dict()`` keys (tied parameters recognised).
"""
from __future__ import annotations

import copy
import os
import sys
import traceback
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn
from torch.export.graph_signature import ConstantArgument, InputKind, OutputKind
from torch.utils._pytree import TreeSpec

from autopar.frontend.call_inputs import CallSignature, map_tensors, split_example
from autopar.core.errors import TraceError
from autopar.core.quiet_logs import quiet_fake_tensor_logs
from autopar.frontend.functionalize import functional
from autopar.frontend.grouped_mm import traceable_grouped_mm
from autopar.frontend.causal_sdpa import causal_sdpa_without_mask
from autopar.frontend.latent_attention import latent_attention_groups
from autopar.frontend.moe_experts import experts_as_ops
from autopar.frontend.opaque_functions import opaque_functions
from autopar.frontend.export_settings import export_settings
from autopar.frontend.static_shapes import check_static_shapes, first_symbolic

_WRAP = "model."


@dataclass
class Traced:
    """A traced training step: ``gm(*params, *buffers, *inputs[, target]) -> outputs``."""

    gm: fx.GraphModule
    params: dict[str, str]            # placeholder -> canonical parameter name
    buffers: dict[str, str]           # placeholder -> buffer name
    constants: dict[str, torch.Tensor]  # placeholder -> lifted constant tensor
    inputs: list[str]                 # placeholders of the user's inputs
    target: str | None                # placeholder of the loss target
    aliases: dict[str, list[str]]     # canonical parameter name -> every name it has (tied)
    buffer_mutations: dict[int, str]  # output index -> buffer name it updates
    loss_index: int | None            # output index of the scalar loss
    output_leaves: list[int]          # output index of each leaf of the model's output, in pytree order
    output_tree: TreeSpec | None      # pytree structure of the model's output (tuple, dict, ModelOutput, ...)
    input_shapes: list[tuple]
    target_shape: tuple | None
    has_loss: bool = False
    meta: dict = field(default_factory=dict)
    input_dtypes: list = field(default_factory=list)   # the user's example inputs' dtypes (before any cast)
    target_dtype: torch.dtype | None = None
    signature: CallSignature | None = None   # how a call's args and kwargs map to ``inputs`` (None: all positional)

    def node(self, name: str) -> fx.Node:
        for n in self.gm.graph.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node named {name!r} in the traced graph")

    @property
    def output_index(self) -> int | None:
        """The output index of the model's output when it is one leaf (None for a structure)."""
        return self.output_leaves[0] if len(self.output_leaves) == 1 else None

    @property
    def batch_size(self) -> int:
        return self.input_shapes[0][0] if self.input_shapes and self.input_shapes[0] else 1


class _Step(nn.Module):
    """model + loss as one module, so the loss is planned with the model."""

    def __init__(self, model: nn.Module, loss_fn, float_loss: bool = False):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.float_loss = float_loss      # fp16: the loss sees fp32 outputs (FSDP2's output_dtype)

    def forward(self, *args, **kwargs):
        if self.loss_fn is None:
            return self.model(*args, **kwargs)
        *inputs, target = args
        out = self.model(*inputs, **kwargs)
        return self.loss(out, target), out

    def loss(self, out, target):
        """Its own frame, so that a failure in ``loss_fn`` is reported as one (``_explain_failure``)."""
        if self.float_loss:
            out = torch.utils._pytree.tree_map(
                lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, out)
        return self.loss_fn(out, target)


def _check_inputs(example_inputs, loss_fn, example_target, example_kwargs=None) -> tuple[tuple, dict]:
    args, kwargs = split_example(example_inputs, example_kwargs)
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function (output, target) -> scalar loss, e.g. "
                        f"torch.nn.functional.cross_entropy; got a {type(loss_fn).__name__}")
    if loss_fn is not None and example_target is None:
        raise ValueError("loss_fn was given without example_target: pass example_target=<a target tensor "
                         "with the global batch shape> so the loss can be traced and planned")
    if example_target is not None and not isinstance(example_target, torch.Tensor):
        raise TypeError(f"example_target must be a tensor, got {type(example_target).__name__}")
    return args, kwargs


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _user_frame(tb, model: nn.Module):
    """Innermost frame of the user's code (not torch's), and the module running there."""
    names = {id(m): n for n, m in model.named_modules()}
    frame_info, module_name = None, None
    for frame, lineno in traceback.walk_tb(tb):
        fname = frame.f_code.co_filename
        if f"{'/'}torch{'/'}" in fname or fname.startswith("<") or fname.startswith(_PACKAGE):
            continue      # torch's frames and autopar's own (its trace-time modes) are not the user's
        frame_info = (fname, lineno, frame.f_code.co_name)
        code = frame.f_code
        owner = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
        if isinstance(owner, nn.Module) and id(owner) in names:
            module_name = names[id(owner)] or "<root>"
    return frame_info, module_name


def _explain_failure(err: Exception, model: nn.Module, example_target=None) -> TraceError:
    frame, module = _user_frame(err.__traceback__, model)
    where = f"in module {module!r}" if module else "in the model"
    line = f" at {frame[0]}:{frame[1]} ({frame[2]})" if frame and frame[0] != __file__ else ""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if any(f.f_code is _Step.loss.__code__ for f, _ in traceback.walk_tb(err.__traceback__)):
        target = (f" (example_target has shape {list(example_target.shape)}, dtype {example_target.dtype})"
                  if isinstance(example_target, torch.Tensor) else "")
        return TraceError(
            f"autopar could not trace loss_fn(model output, example_target){line}: {type(err).__name__}: {first}\n"
            f"What to try: check that loss_fn takes the model's output and the target and returns a scalar, and that "
            f"example_target matches the output{target}.")
    return TraceError(
        f"autopar could not trace the model {where}{line}: {type(err).__name__}: {first}\n"
        "What to try: make control flow independent of tensor values (torch.cond or plain Python on shapes), "
        "avoid .item()/.tolist()/numpy inside forward, pass every input as a tensor in example_inputs, "
        "and for Hugging Face models set use_cache=False.")


def _canonical_params(model: nn.Module) -> tuple[dict[int, str], dict[str, list[str]]]:
    canon: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first = canon.setdefault(id(p), name)
        aliases.setdefault(first, []).append(name)
    return canon, aliases


_COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(mixed_precision: str | None) -> torch.dtype | None:
    """The dtype a mixed-precision policy computes in (None: the model's own dtypes)."""
    if mixed_precision is None:
        return None
    if mixed_precision not in _COMPUTE_DTYPES:
        raise ValueError(f"mixed_precision={mixed_precision!r} is not supported; use None or "
                         f"{', '.join(repr(k) for k in _COMPUTE_DTYPES)}")
    return _COMPUTE_DTYPES[mixed_precision]


def cast_floating(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` in ``dtype`` when both are floating point (a differentiable cast), else ``t``."""
    return t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t


def working_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A meta-device clone of ``model`` whose floating parameters are in ``dtype`` (buffers keep
    theirs): what a mixed-precision step computes with, for tracing only (no weights copied)."""
    memo: dict[int, object] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta", dtype=dtype if p.is_floating_point() else None),
                                   requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def trace(model: nn.Module, example_inputs, loss_fn=None, example_target=None,
          mixed_precision: str | None = None, example_kwargs: dict | None = None) -> Traced:
    """Trace ``model`` (and ``loss_fn(model(*inputs, **kwargs), target)``) to an aten-level graph; with
    ``mixed_precision`` ("bf16", "fp16"), the step as it runs on 16-bit working copies of the parameters,
    floating inputs cast to 16 bits (FSDP2's MixedPrecisionPolicy: param_dtype, cast_forward_inputs);
    under "fp16" the loss_fn gets the outputs in fp32 (output_dtype=fp32: a loss scale of 2^16 does not
    overflow the loss's own gradient, and softmax-like losses keep fp32 range).
    ``example_kwargs``: keyword inputs, as torch.export's ``kwargs`` (``call_inputs.py``: tensors are
    graph inputs after the positional ones, None and plain constants are traced in)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    args, kwargs = _check_inputs(example_inputs, loss_fn, example_target, example_kwargs)
    signature = CallSignature.of(args, kwargs)
    inputs = tuple(signature.flatten(args, kwargs))
    dtypes = [x.dtype for x in inputs]
    dtype = compute_dtype(mixed_precision)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    stored = {n: p.dtype for n, p in model.named_parameters(remove_duplicate=False)}
    if dtype is not None:
        model = working_copy(model, dtype)
        args, kwargs = map_tensors(lambda x: cast_floating(x.to("meta"), dtype), args, kwargs)
        inputs = tuple(signature.flatten(args, kwargs))
        example_target = example_target.to("meta") if example_target is not None else None
    if loss_fn is not None and any(_aliases(example_target, x) for x in inputs):
        example_target = example_target.clone()    # its own placeholder, as in every microbatch trace
    args = args + ((example_target,) if loss_fn is not None else ())
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta:
        args, kwargs = map_tensors(lambda a: a.to("meta"), args, kwargs)
    step = _Step(model, loss_fn, float_loss=mixed_precision == "fp16")
    ep = functional(_export(step, args, kwargs, model, example_target, record_stack=False))
    if first_symbolic(ep.graph_module) is not None:      # its error names the source line: export with them
        ep = functional(_export(step, args, kwargs, model, example_target, record_stack=True))
    check_static_shapes(ep.graph_module, _WRAP)
    traced = _from_exported(ep, model, inputs, example_target, loss_fn is not None,
                            signature.num_positional_tensors)
    traced.input_dtypes = dtypes
    traced.target_dtype = example_target.dtype if example_target is not None else None
    traced.signature = signature
    if dtype is not None:
        traced.meta["mixed_precision"] = mixed_precision
        traced.meta["stored_dtypes"] = stored      # the masters' dtypes (the graph sees the working copies')
    if dtype is not None or on_meta:
        _retarget_device(traced.gm, run_device() if device.type == "meta" else device)
    traced.gm.recompile()          # once, after every edit above
    return traced


def _export(step: nn.Module, args, kwargs, model: nn.Module, example_target, record_stack: bool):
    """``torch.export`` of the step (non-strict), nodes' stack traces recorded only where ``record_stack``."""
    try:
        with opaque_functions(), experts_as_ops(model), latent_attention_groups(model), traceable_grouped_mm(), \
                causal_sdpa_without_mask(), quiet_fake_tensor_logs(), export_settings(record_stack):
            return torch.export.export(step, args, kwargs or None, strict=False)
    except TraceError:
        raise
    except Exception as err:  # noqa: BLE001 - every failure is reported with its location
        raise _explain_failure(err, model, example_target) from err


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether export would see one tensor (it keeps a single placeholder for inputs that alias,
    e.g. a language model's tokens passed as the target too: then the graph reads the model's
    input from the target's placeholder, unlike the traces of microbatches, sliced apart)."""
    if a is b or a.is_meta or b.is_meta:
        return a is b or (a.is_meta and b.is_meta)
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _from_exported(ep, model, inputs, example_target, has_loss, positional: int) -> Traced:
    """``positional``: how many of the user's tensor inputs are positional (the target follows them)."""
    canon_by_id, aliases = _canonical_params(model)
    by_name = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    sig = ep.graph_signature
    params, buffers, constants, user, traced_in = {}, {}, {}, [], []
    for spec in sig.input_specs:
        ph = spec.arg.name
        if spec.kind == InputKind.PARAMETER:
            name = spec.target[len(_WRAP):]
            params[ph] = canon_by_id[id(by_name[name])]
        elif spec.kind == InputKind.BUFFER:
            buffers[ph] = spec.target[len(_WRAP):]
        elif spec.kind in (InputKind.CONSTANT_TENSOR,):
            constants[ph] = ep.constants[spec.target]
        elif spec.kind == InputKind.USER_INPUT and isinstance(spec.arg, ConstantArgument):
            traced_in.append(ph)       # None or a plain constant: specialised into the graph
        elif spec.kind == InputKind.USER_INPUT:
            user.append(ph)
        else:
            raise TraceError(f"unsupported graph input kind {spec.kind} for {spec.target!r}")
    target = user.pop(positional) if has_loss else None
    mutations, user_out = {}, []
    for i, spec in enumerate(sig.output_specs):
        if spec.kind == OutputKind.BUFFER_MUTATION:
            mutations[i] = spec.target[len(_WRAP):]
        elif spec.kind == OutputKind.USER_OUTPUT:
            user_out.append(i)
        else:
            raise TraceError(f"unsupported graph output kind {spec.kind}")
    gm = ep.graph_module
    _drop_constant_inputs(gm, traced_in)
    _merge_tied(gm, params)
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        path = list(stack.values())[-1][0] if stack else ""
        node.meta["module_path"] = path[len(_WRAP):] if path.startswith(_WRAP) else ("" if path == "model" else path)
    tree = ep.call_spec.out_spec
    loss_index = None
    if has_loss:
        loss_index, leaves = user_out[0], user_out[1:]
        child = tree.child if hasattr(tree, "child") else lambda i: tree.children_specs[i]
        _check_loss(child(0), _output_vals(gm)[loss_index])
        tree = child(1)                                                # (loss, model output)
    else:
        leaves = user_out
        out_vals = [_output_vals(gm)[i] for i in leaves]
        if len(out_vals) == 1 and isinstance(out_vals[0], torch.Tensor) and out_vals[0].dim() == 0:
            loss_index = leaves[0]
    return Traced(gm=gm, params=params, buffers=buffers, constants=constants, inputs=user, target=target,
                  aliases=aliases, buffer_mutations=mutations, loss_index=loss_index, output_leaves=leaves,
                  output_tree=tree,
                  input_shapes=[tuple(t.shape) for t in inputs],
                  target_shape=tuple(example_target.shape) if example_target is not None else None,
                  has_loss=loss_index is not None)


def _check_loss(spec: TreeSpec, val) -> None:
    """The traced ``loss_fn`` returned one scalar tensor (what ``backward()`` needs), else a ValueError
    saying how to reduce it."""
    if not spec.is_leaf():
        raise ValueError(f"loss_fn returned a {spec.type.__name__} of {spec.num_leaves} values, not one scalar "
                         "tensor: return only the loss (compute other values outside the training step)")
    if not isinstance(val, torch.Tensor):
        raise ValueError(f"loss_fn returned a {type(val).__name__}, not a scalar tensor: return a tensor computed "
                         "from the model's output")
    if val.dim() != 0:
        raise ValueError(f"loss_fn returned a tensor of shape {list(val.shape)}, not a scalar: autopar trains on one "
                         "scalar loss per step (backward needs one). Reduce it in loss_fn with .mean() or .sum(), "
                         "e.g. reduction='mean' instead of reduction='none'")


def run_device() -> torch.device:
    """Where a rank runs a model given on the meta device: ``cuda:LOCAL_RANK`` with CUDA, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _retarget_device(gm: fx.GraphModule, device: torch.device) -> None:
    """Tensors a graph makes itself (arange, full, ...) on ``device`` instead of the meta device the
    working copy was traced on. Export's ``_assert_tensor_metadata`` checks (of a cast in the model or
    loss) are dropped: they name one device, and the graph runs on meta (pipeline split) and on ``device``.
    ``trace`` recompiles ``gm`` after its edits (as after ``_drop_constant_inputs`` and ``_merge_tied``)."""
    if device.type == "meta":
        return
    meta = torch.device("meta")
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default \
                and not node.users:
            gm.graph.erase_node(node)
            continue
        if node.op == "call_function" and node.kwargs.get("device") == meta:
            node.kwargs = {**node.kwargs, "device": device}
        if node.op == "call_function" and any(isinstance(a, torch.device) and a == meta for a in node.args):
            node.args = tuple(device if isinstance(a, torch.device) and a == meta else a for a in node.args)


def _drop_constant_inputs(gm: fx.GraphModule, names: list[str]) -> None:
    """Remove the placeholders of constant inputs (export keeps them, unused: their value is traced in)."""
    for node in [n for n in gm.graph.nodes if n.op == "placeholder" and n.name in names]:
        if node.users:
            raise TraceError(f"the graph reads the constant input {node.name!r}; pass it as a tensor")
        gm.graph.erase_node(node)


def _merge_tied(gm: fx.GraphModule, params: dict[str, str]) -> None:
    """One placeholder per Parameter: later placeholders of a tied parameter are merged into the first."""
    first: dict[str, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "placeholder" or node.name not in params:
            continue
        canon = params[node.name]
        if canon in first:
            node.replace_all_uses_with(first[canon])
            gm.graph.erase_node(node)
            del params[node.name]
        else:
            first[canon] = node


def _output_vals(gm: fx.GraphModule) -> list:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return [a.meta.get("val") if isinstance(a, fx.Node) else a for a in out.args[0]]


def module_path(node: fx.Node) -> str:
    return node.meta.get("module_path", "")


if sys.version_info < (3, 10):  # pragma: no cover
    raise ImportError("autopar needs Python 3.10 or newer")
