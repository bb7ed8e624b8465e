"""Hugging Face mixture-of-experts modules as ONE traced node each.

Every HF MoE family (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, GPT-OSS, GraniteMoE, ...) defines an
experts module decorated by ``transformers.integrations.moe.use_experts_implementation``:
``forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``, every parameter
with the expert dimension first. Traced through, its default implementation (sort, histc,
grouped_mm) can only run replicated. While ``experts_as_ops(model)`` is active (``trace.py``), a
call of such a module records ONE node of the custom op

    ``autopar::moe_experts(str key, Tensor hidden, Tensor top_k_index, Tensor top_k_weights,
    Tensor[] params) -> Tensor``

* ``key`` names a process-global registry entry (:class:`ExpertsEntry`): a copy of the module with
  its parameters on the meta device (the template the per-rank code runs), the expert count, top-k
  and layout facts. It is the class name and a digest of the parameters' names, shapes and dtypes,
  the module's plain attributes and the experts implementation, so every rank tracing the same model
  gets the same key and every layer of one shape shares it.
* fake implementation: a new tensor like ``hidden`` (the module never runs on fake tensors); real
  implementation (no grad): the module's own forward on the given parameters.
* the op has NO autograd: ``passes/insert_collectives.py`` replaces every such node of a per-rank
  program by ``collectives/moe_dispatch.py``'s implementation, which calls :func:`run_experts`, the
  module's own forward (whatever ``config._experts_implementation`` is) with autograd through
  ``torch.func.functional_call`` on the rank's parameter pieces.

Recognised: an instance of a class wrapped by ``use_experts_implementation`` (its ``forward`` is
the wrapper in ``transformers/integrations/moe.py``; the wrapper's layout flags set) with an integer
``num_experts``, no buffers, and every parameter's dim 0 equal to ``num_experts``; a call of the
form ``(hidden [T, H], top_k_index [T, k] integer, top_k_weights [T, k])``. Anything else is
traced through as before.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
from dataclasses import dataclass

import torch
import torch.nn as nn

_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated")


@dataclass
class ExpertsEntry:
    """What the per-rank code and the cost model need to know about one experts module kind."""

    template: nn.Module           # the module, parameters on the meta device
    num_experts: int
    top_k: int
    param_names: tuple[str, ...]  # ``named_parameters()`` order: the op's ``params``
    param_shapes: tuple[tuple, ...]
    has_gate: bool
    has_bias: bool
    is_transposed: bool
    is_concatenated: bool
    implementation: str           # config._experts_implementation

    @property
    def name(self) -> str:
        cls = type(self.template)
        return f"{cls.__module__}.{cls.__qualname__}"

    @property
    def per_expert_numel(self) -> int:
        """Parameters of one expert (the FLOPs of one routed row are twice this, forward)."""
        return sum(int(torch.Size(s).numel()) // self.num_experts for s in self.param_shapes)


_REGISTRY: dict[str, ExpertsEntry] = {}


def entry(key: str) -> ExpertsEntry:
    """The registry entry named ``key`` (registered when the model was traced in this process)."""
    found = _REGISTRY.get(key)
    if found is None:
        raise RuntimeError(f"autopar::moe_experts: no experts module registered under {key!r} in this process; "
                           "trace the model in this process (autopar.parallelize does) before running its graph")
    return found


def registered(key: str) -> ExpertsEntry | None:
    """The registry entry named ``key``, or None when no traced module registered it in this process."""
    return _REGISTRY.get(key)


def is_hf_experts(module: nn.Module) -> bool:
    """Whether ``module``'s class is wrapped by transformers' ``use_experts_implementation``."""
    fwd = getattr(type(module), "forward", None)
    code = getattr(fwd, "__code__", None)
    if code is None or getattr(fwd, "__wrapped__", None) is None:
        return False
    path = code.co_filename.replace("\\", "/")
    return path.endswith("transformers/integrations/moe.py") and all(hasattr(module, f) for f in _FLAGS) \
        and hasattr(getattr(module, "config", None), "_experts_implementation")


def why_not_opaque(module: nn.Module) -> str | None:
    """None when ``module`` is an experts module autopar keeps as one op, else the reason it is traced through."""
    if not is_hf_experts(module):
        return "not a transformers experts module (use_experts_implementation)"
    e = getattr(module, "num_experts", None)
    if not isinstance(e, int) or isinstance(e, bool) or e < 1:
        return f"num_experts is {e!r}, not a positive int"
    if any(True for _ in module.buffers()):
        return "it has buffers"
    params = list(module.named_parameters())
    if not params:
        return "it has no parameters"
    bad = [n for n, p in params if p.dim() == 0 or p.shape[0] != e]
    if bad:
        return f"parameter(s) {bad} do not have num_experts={e} as dim 0"
    return None


def _plain_attrs(module: nn.Module) -> tuple:
    return tuple(sorted((k, v) for k, v in vars(module).items()
                        if not k.startswith("_") and k != "training"
                        and isinstance(v, (bool, int, float, str, type(None)))))


def _key(module: nn.Module, top_k: int) -> str:
    cls = type(module)
    facts = (tuple((n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()), _plain_attrs(module),
             module.config._experts_implementation, top_k)
    digest = hashlib.sha1(repr(facts).encode()).hexdigest()[:10]
    return f"{cls.__module__}.{cls.__qualname__}:{digest}"


def _template(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with meta parameters (made before tracing swaps in fake ones)."""
    memo = {id(p): nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
            for p in module.parameters()}
    out = copy.deepcopy(module, memo)
    out.__dict__.pop("forward", None)
    return out


def _register(module: nn.Module, template: nn.Module, top_k: int) -> str:
    key = _key(module, top_k)
    if key not in _REGISTRY:
        params = list(module.named_parameters())
        _REGISTRY[key] = ExpertsEntry(
            template, module.num_experts, top_k, tuple(n for n, _ in params),
            tuple(tuple(p.shape) for _, p in params), *(bool(getattr(module, f)) for f in _FLAGS),
            str(module.config._experts_implementation))
    return key


def run_experts(key: str, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                params: list[torch.Tensor], num_experts: int | None = None) -> torch.Tensor:
    """The module's own forward on ``params`` (autograd as the caller's mode has it). ``num_experts``:
    the count of experts ``params`` hold when they are a rank's piece (ids then local: 0..num_experts-1)."""
    e = entry(key)
    module = e.template
    if num_experts is not None and num_experts != e.num_experts:
        module = copy.copy(module)          # shallow: the template keeps its count
        module.num_experts = num_experts
    if e.implementation == "grouped_mm" and not _grouped_mm_aligned([hidden, *params]):
        module = copy.copy(module)          # a rank's piece torch's grouped GEMM refuses: the same math in bmm
        module.config = copy.copy(module.config)
        module.config._experts_implementation = "batched_mm"
    return torch.func.functional_call(module, dict(zip(e.param_names, params)),
                                      (hidden, top_k_index, top_k_weights), strict=True)


def _grouped_mm_aligned(tensors: list[torch.Tensor]) -> bool:
    """Whether torch's grouped GEMM takes the module's operands built from these (the rank's hidden rows
    and expert weights, laid out contiguously): each row 16-byte aligned. A piece split finely (expert
    tensor parallelism over several axes) can leave e.g. 6 fp32 columns, which ``torch._grouped_mm``
    refuses ("strides should be multiple of 16 bytes")."""
    return all((t.shape[-1] * t.element_size()) % 16 == 0 for t in tensors if t.is_floating_point() and t.dim() >= 2)


@torch.library.custom_op("autopar::moe_experts", mutates_args=())
def moe_experts(key: str, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                params: list[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        out = run_experts(key, hidden, top_k_index, top_k_weights, list(params))
    return out.clone() if out is hidden else out


@moe_experts.register_fake
def _fake(key, hidden, top_k_index, top_k_weights, params):
    return torch.empty_like(hidden)


def _call_form(args, kwargs):
    """(hidden, index, weights) when the call has the experts form, else None."""
    names = ("hidden_states", "top_k_index", "top_k_weights")
    if len(args) > 3 or any(k not in names[len(args):] for k in kwargs):
        return None
    vals = list(args) + [kwargs.get(n) for n in names[len(args):]]
    h, idx, w = vals
    if not all(isinstance(t, torch.Tensor) for t in vals):
        return None
    if h.dim() != 2 or idx.dim() != 2 or tuple(w.shape) != tuple(idx.shape) or idx.shape[0] != h.shape[0]:
        return None
    if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool or not w.is_floating_point():
        return None
    return h, idx, w


def _opaque_forward(module: nn.Module):
    original = type(module).forward
    template = _template(module)

    def forward(*args, **kwargs):
        form = _call_form(args, kwargs)
        if form is None:
            return original(module, *args, **kwargs)
        h, idx, w = form
        key = _register(module, template, int(idx.shape[1]))
        params = [p for _, p in module.named_parameters()]
        return torch.ops.autopar.moe_experts.default(key, h, idx, w, params)

    return forward


@contextlib.contextmanager
def experts_as_ops(model: nn.Module):
    """While active, each recognised experts module of ``model`` records one ``autopar::moe_experts`` call."""
    patched = [m for m in model.modules() if why_not_opaque(m) is None]
    for m in patched:
        m.__dict__["forward"] = _opaque_forward(m)
    try:
        yield patched
    finally:
        for m in patched:
            m.__dict__.pop("forward", None)
