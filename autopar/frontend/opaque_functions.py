"""Keep user ``torch.autograd.Function``s opaque through tracing.

Non-strict ``torch.export`` inlines a Function's forward into the aten graph, so the per-rank
program would differentiate the traced forward (``round`` → zero gradient) instead of calling
the Function's own backward. While ``opaque_functions()`` is active, ``Function.apply`` of a
user subclass (one not defined inside torch) records ONE node of the custom op
``autopar::autograd_function(str key, Tensor[] args) -> Tensor[]`` instead:

* ``key`` names a process-global registry entry: the Function class, the structure of the
  ``apply`` arguments and their non-tensor values. It is derived from the class name and a
  digest of those values (plain values print alike in every process), so every rank tracing
  the same model gets the same key, and a retrace at another batch shape reuses the entry.
* fake and real implementations run the Function's forward without grad. At trace time the
  forward is watched: one that writes into an input, reads a traced tensor it was not given
  (a parameter behind a closure), gets a module, or returns non-tensors is a ``TraceError``.
* the backward recomputes: it re-runs ``cls.apply`` on detached inputs with grad enabled,
  under the RNG state the forward saw, and calls ``torch.autograd.grad``, so the Function's
  own backward produces the gradients. The forward thus runs twice per step; in exchange the
  op needs no hand-made ``ctx`` and keeps no autograd graph between forward and backward.

The op has no sharding rule, so the solver runs it replicated (inputs gathered first).
"""
from __future__ import annotations

import contextlib
import hashlib
import threading
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from autopar.core.errors import TraceError

_WHAT_TO_DO = ("keep it opaque by passing tensors (and plain Python values) as apply's arguments and returning "
               "a tensor or a tuple of tensors, or call its forward's ops directly in the model if autograd of "
               "them is what you want")


@dataclass
class _Entry:
    cls: type
    in_spec: TreeSpec
    consts: list                # non-tensor leaves of (args, kwargs); None where a tensor goes
    out_spec: TreeSpec | None = None

    def same(self, other: "_Entry") -> bool:
        return self.cls is other.cls and self.in_spec == other.in_spec and len(self.consts) == len(other.consts) \
            and all(_same_value(a, b) for a, b in zip(self.consts, other.consts))

    @property
    def name(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"


_REGISTRY: dict[str, _Entry] = {}
_STATE = threading.local()


def _same_value(a, b) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - values that cannot be compared are different
        return False


def _register(entry: _Entry) -> str:
    digest = hashlib.sha1(repr((entry.in_spec, entry.consts)).encode()).hexdigest()[:8]
    base = f"{entry.name}:{digest}"
    key, n = base, 0
    while key in _REGISTRY and not _REGISTRY[key].same(entry):
        n += 1
        key = f"{base}+{n}"
    _REGISTRY.setdefault(key, entry)
    return key


def _entry(key: str) -> _Entry:
    entry = _REGISTRY.get(key)
    if entry is None:
        raise RuntimeError(f"autopar::autograd_function: no Function registered under {key!r} in this process; "
                           "trace the model in this process (autopar.parallelize does) before running its graph")
    return entry


class _ForwardCheck(TorchDispatchMode):
    """Watches a forward at trace time: does it write into an input, or read a traced (fake)
    tensor it was not given, such as a model parameter it reaches through a closure?"""

    def __init__(self, inputs):
        super().__init__()
        self.inputs = inputs
        self.made: dict[int, torch.Tensor] = {}
        self.written = self.captured = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for v in tree_flatten((args, kwargs))[0]:
            if isinstance(v, FakeTensor) and id(v) not in self.made and not self._aliases_input(v):
                self.captured = True
        if func._schema.is_mutable:
            for i, a in enumerate(func._schema.arguments):
                v = args[i] if i < len(args) else kwargs.get(a.name)
                if a.alias_info is not None and a.alias_info.is_write and isinstance(v, torch.Tensor):
                    self.written |= self._aliases_input(v)
        out = func(*args, **kwargs)
        self.made.update((id(t), t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out

    def _aliases_input(self, t: torch.Tensor) -> bool:
        return any(torch._C._is_alias_of(t, i) for i in self.inputs)


def _run_forward(key: str, tensors: list[torch.Tensor], check: bool = False) -> list[torch.Tensor]:
    """The Function's forward without grad; outputs flattened, never aliasing an input.
    ``check`` (at trace time) refuses a forward that writes into its inputs or captures tensors."""
    entry = _entry(key)
    it = iter(t.detach() for t in tensors)
    leaves = [next(it) if c is None else c for c in entry.consts]
    args, kwargs = tree_unflatten(leaves, entry.in_spec)
    watch = _ForwardCheck(tensors) if check else contextlib.nullcontext()
    with torch.no_grad(), _native(), watch:
        out = entry.cls.apply(*args, **kwargs)
    if check and watch.written:
        raise TraceError(f"autograd Function {entry.name} modifies an input in place, so autopar cannot keep it "
                         f"opaque: return a new tensor instead (no ctx.mark_dirty); {_WHAT_TO_DO}")
    if check and watch.captured:
        raise TraceError(f"autograd Function {entry.name} uses a model tensor that is not an argument of apply (a "
                         "parameter reached through a closure or class attribute?), so autopar cannot keep it opaque: "
                         f"its gradient and per-rank copy would be lost; {_WHAT_TO_DO}")
    flat, spec = tree_flatten(out)
    bad = [type(o).__name__ for o in flat if not isinstance(o, torch.Tensor)]
    if bad or not flat:
        raise TraceError(f"autograd Function {entry.name} returns {', '.join(bad) or 'no tensor'}, so autopar cannot "
                         f"keep it opaque (its outputs must all be tensors); {_WHAT_TO_DO}")
    entry.out_spec = spec
    return _fresh(flat, tensors)


def _fresh(outs: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A custom op may not return an input, a view of one or the same tensor twice: clone those."""
    result = []
    for o in outs:
        if any(torch._C._is_alias_of(o, t) for t in (*inputs, *result)):
            o = o.clone()
        result.append(o)
    return result


@torch.library.custom_op("autopar::autograd_function", mutates_args=())
def autograd_function(key: str, args: list[torch.Tensor]) -> list[torch.Tensor]:
    _STATE.rng = _rng_state(args)
    return _run_forward(key, args)


@autograd_function.register_fake
def _fake(key: str, args: list[torch.Tensor]) -> list[torch.Tensor]:
    return _run_forward(key, args, check=True)


def _rng_devices(tensors) -> list[int]:
    return sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})


def _rng_state(tensors) -> tuple:
    devices = _rng_devices(tensors)
    return devices, torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]


@contextlib.contextmanager
def _replayed_rng(state):
    """Run under the RNG state the forward saw; the global state is left as it was."""
    if state is None:
        yield
        return
    devices, cpu_state, cuda_states = state
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(cpu_state)
        for d, s in zip(devices, cuda_states):
            torch.cuda.set_rng_state(s, d)
        yield


def _setup_context(ctx, inputs, output) -> None:
    key, args = inputs
    ctx.key = key
    ctx.rng = _STATE.__dict__.pop("rng", None)  # None where no real forward ran (fake tensors)
    ctx.save_for_backward(*args)


def _backward(ctx, grads):
    """Recompute the forward with grad (same RNG state) and let the Function's backward run."""
    entry = _entry(ctx.key)
    needs = ctx.needs_input_grad[1]
    tensors = [t.detach().requires_grad_(bool(n) and (t.is_floating_point() or t.is_complex()))
               for t, n in zip(ctx.saved_tensors, needs)]
    it = iter(tensors)
    leaves = [next(it) if c is None else c for c in entry.consts]
    args, kwargs = tree_unflatten(leaves, entry.in_spec)
    with _replayed_rng(ctx.rng), torch.enable_grad(), _native():
        outs, _ = tree_flatten(entry.cls.apply(*args, **kwargs))
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    wanted = [t for t in tensors if t.requires_grad]
    got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
               if pairs and wanted else [None] * len(wanted))
    return None, [next(got) if t.requires_grad else None for t in tensors]


autograd_function.register_autograd(_backward, setup_context=_setup_context)


def _is_user_function(cls) -> bool:
    module = getattr(cls, "__module__", "") or ""
    return module != "torch" and not module.startswith(("torch.", "functorch"))


@contextlib.contextmanager
def _native():
    """Within a Function's own forward, Functions apply natively."""
    prev = getattr(_STATE, "native", False)
    _STATE.native = True
    try:
        yield
    finally:
        _STATE.native = prev


def _opaque_apply(cls, args, kwargs):
    flat, in_spec = tree_flatten((args, kwargs))
    for leaf in flat:
        if isinstance(leaf, nn.Module):
            raise TraceError(f"autograd Function {cls.__module__}.{cls.__qualname__} gets the module "
                         f"{type(leaf).__name__} as an argument, so autopar cannot keep it opaque: its parameters "
                         "would bypass the traced graph. Pass the tensors it uses as arguments of apply instead")
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    entry = _Entry(cls, in_spec, [None if isinstance(t, torch.Tensor) else t for t in flat])
    key = _register(entry)
    outs = torch.ops.autopar.autograd_function(key, tensors)
    return tree_unflatten(list(outs), _REGISTRY[key].out_spec)


@contextlib.contextmanager
def opaque_functions():
    """While active, every user ``autograd.Function.apply`` becomes one opaque custom-op call."""
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if _is_user_function(cls) and not getattr(_STATE, "native", False):
            return _opaque_apply(cls, args, kwargs)
        return original.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = original
