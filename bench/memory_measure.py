"""Count one rank's training memory exactly, for comparing with the plan's prediction.

For a per-rank module ``pmodel`` (what ``autopar.parallelize`` returns: a ParallelModule or a
PipelineModule) and its optimizer, :func:`measure_step` runs ``pmodel.step`` once under
``torch.autograd.graph.saved_tensors_hooks``, then the optimizer step, and counts (bytes, this
rank, every storage once):

* ``params``: the storages of ``pmodel.parameters()`` (tied weights once);
* ``grads``: the storages of their ``.grad`` after backward (DDP's bucket views count as the
  bucket: ``gradient_as_bucket_view=True`` makes the bucket the gradient);
* ``optimizer``: the tensors in ``optimizer.state`` after the step (Adam's moments, the
  per-parameter ``step`` scalars, fp32 masters if any);
* ``activations``: the peak, over the step, of the storages held by autograd's saved tensors.
  The pack hook keeps a handle whose lifetime is the saved tensor's (freed when backward
  releases the graph), so a pipeline stage's peak is the peak over its in-flight microbatches.
  Parameters (and anything else that is state) are not activations.

``peak = params + grads + optimizer + activations``. NOT included: forward temporaries that no
op saves (freed as soon as their consumer runs), the gradients flowing through backward (the
workspace of one op at a time), received pipeline buffers, communication buffers and the
allocator's rounding/fragmentation. ``torch.cuda.max_memory_allocated`` (``bench/memory_accuracy.py
--cuda``) sees those too. The plan's ``memory_per_device`` is its predicted peak: state + saved
activations + gathered parameters + the largest op's backward gradients (``transient`` in
``memory_breakdown``); the CPU count is compared with the peak less ``transient`` and less ZeRO-3's
gathered layers (live buffers, not saved tensors: the count does not see them; :func:`predicted`
gives both).

Counting ``params``/``grads``/``optimizer`` exactly means they are *measured*, not inferred from a
formula: a bf16 model's AdamW moments are bf16 (``torch.zeros_like(p)``), a fp32 model's fp32.
"""
from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass

import torch
import torch.utils._pytree
from torch.utils._python_dispatch import TorchDispatchMode

GB = 1e9


@dataclass
class MemoryCount:
    """Bytes on one rank: the state after a step and the saved-activation peak during it."""

    params: int
    grads: int
    optimizer: int
    activations: int        # peak bytes of saved-for-backward storages during the step

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.state + self.activations

    def as_dict(self) -> dict:
        return {**asdict(self), "state": self.state, "total": self.total}


def _key(t: torch.Tensor):
    s = t.untyped_storage()
    return (t.device.type, t.device.index, s.data_ptr()), int(s.nbytes())


def unique_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None and non-tensors skipped)."""
    seen: dict = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            k, n = _key(t)
            seen[k] = n
    return sum(seen.values())


def _state_tensors(optimizer) -> list[torch.Tensor]:
    out = []
    for st in optimizer.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                out.append(v)
    return out


class SavedTensorMeter:
    """Live bytes of the storages autograd saves for backward, and their peak.

    ``exclude``: storage keys never counted (parameters). Each pack returns a handle; a storage
    counts while some handle for it is alive (``weakref.finalize`` on the handle)."""

    def __init__(self, exclude=()):
        self.exclude = set(exclude)
        self.refs: dict = {}
        self.sizes: dict = {}
        self.live = 0
        self.peak = 0
        self.describe: dict = {}        # storage key -> (shape, dtype) of its first saved view
        self.at_peak: dict = {}         # key -> (bytes, shape, dtype) live at the peak (``debug``)
        self.debug = False              # keep ``at_peak``: what is live at the peak, to find what a model misses

    def _release(self, key):
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= self.sizes.pop(key)

    def pack(self, t: torch.Tensor):
        handle = _Handle(t)
        if t.device.type == "meta":
            return handle
        key, nbytes = _key(t)
        if key in self.exclude or nbytes == 0:
            return handle
        if key not in self.refs:
            self.refs[key] = 0
            self.sizes[key] = nbytes
            self.live += nbytes
            if self.debug:
                self.describe[key] = (tuple(t.shape), str(t.dtype).replace("torch.", ""))
            if self.live > self.peak and self.debug:
                self.at_peak = {k: (self.sizes[k],) + self.describe[k] for k in self.refs}
                self.at_peak[key] = (nbytes,) + self.describe[key]
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        weakref.finalize(handle, self._release, key)
        return handle

    @staticmethod
    def unpack(handle):
        return handle.t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Handle:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


class LivePeak(TorchDispatchMode):
    """Live bytes of every storage an op returns (and of ``external`` tensors), and their peak.

    A dispatch mode sees each aten op below autograd, backward's included: parameters, gradients,
    optimizer state, saved activations, the temporaries no op saves, collective buffers and the
    optimizer's own temporaries. A storage counts from the op that returns it until it is freed
    (a weak reference to the storage itself, polled after each op); views share their storage.
    What a GPU's ``max_memory_allocated`` adds on top is the allocator's rounding and
    fragmentation, and scratch a kernel allocates and frees inside one op."""

    def __init__(self, external=(), debug: bool = False):
        super().__init__()
        self.live: dict = {}        # (device, data_ptr) -> (weak ref, bytes)
        self.bytes = 0
        self.peak = 0
        self.debug = debug          # keep ``at_peak``: (bytes, made by, shape, dtype) of what is live at the peak
        self.made: dict = {}
        self.at_peak: list = []
        for t in external:
            self._add(t, "before the step")
        self.peak = self.bytes

    def _add(self, t, made_by: str = "") -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        if hasattr(t, "to_local"):
            t = t.to_local()
        s = t.untyped_storage()
        n = int(s.nbytes())
        key = (t.device.type, t.device.index, s.data_ptr())
        if n == 0 or (key in self.live and not torch.UntypedStorage._expired(self.live[key][0])):
            return
        if key in self.live:
            self._drop(key)
        self.live[key] = (s._weak_ref(), n)
        self.bytes += n
        if self.debug:
            self.made[key] = (n, made_by, tuple(t.shape), str(t.dtype).replace("torch.", ""))

    def _drop(self, key) -> None:
        ref, n = self.live.pop(key)
        torch.UntypedStorage._free_weak_ref(ref)
        self.bytes -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in [k for k, (ref, _) in self.live.items() if torch.UntypedStorage._expired(ref)]:
            self._drop(key)
        for t in torch.utils._pytree.tree_leaves(out):
            self._add(t, str(func))
        if self.bytes > self.peak and self.debug:
            self.at_peak = sorted((self.made[k] for k in self.live), reverse=True)
        self.peak = max(self.peak, self.bytes)
        return out


def live_peak(step, module, optimizer, *tensors) -> int:
    """Peak live bytes on this rank while ``step()`` runs (:class:`LivePeak`), counting from the
    start what exists before it: ``module``'s parameters and gradients, ``optimizer``'s state
    and ``tensors`` (the inputs)."""
    params = list(module.parameters())
    state = _state_tensors(optimizer) if optimizer is not None else []
    meter = LivePeak([*params, *(p.grad for p in params), *state, *tensors])
    with meter:
        step()
    for key in list(meter.live):
        meter._drop(key)
    return meter.peak


def state_count(pmodel, optimizer) -> tuple[int, int, int]:
    params = [p for p in pmodel.parameters()]
    return (unique_bytes(params), unique_bytes(p.grad for p in params),
            unique_bytes(_state_tensors(optimizer)))


def measure_step(pmodel, optimizer, inputs: tuple, target, steps: int = 1) -> MemoryCount:
    """Run ``steps`` training steps (step, optimizer step, zero_grad(set_to_none=False) between
    steps so gradients stay allocated, as at the peak of the next step) and count the last one.
    The activation peak is measured on the last step."""
    meter = None
    for i in range(steps):
        # parameters only: their storages live through the step. Gradients and optimizer states
        # never pass through autograd's saved tensors, and a gradient set aside (freed) at the
        # start of the step would leave a stale address that a new activation can take.
        meter = SavedTensorMeter({_key(p)[0] for p in pmodel.parameters()})
        with meter.hooks():
            pmodel.step(*inputs, target=target)
        optimizer.step()
        if i < steps - 1:
            optimizer.zero_grad(set_to_none=False)
    p, g, o = state_count(pmodel, optimizer)
    return MemoryCount(p, g, o, meter.peak)


def predicted(plan, rank: int) -> dict:
    """The plan's prediction for ``rank``: ``peak`` (``memory_per_device[rank]``, what
    ``torch.cuda.max_memory_allocated`` measures), ``total`` (the peak less the ``transient``
    workspace: what the CPU count measures) and the breakdown the plan gives."""
    breakdown = {k: float(v) for k, v in (plan.memory_breakdown or {}).items()}
    peak = float(plan.memory_per_device[rank])
    unseen = (breakdown.get("transient", 0.0) + breakdown.get("accumulated gradients", 0.0)
              + breakdown.get("ZeRO-3 gathered layers", 0.0)
              + breakdown.get("ZeRO-2 gradient bucket", 0.0))
    return {"peak": peak, "total": peak - unseen, **breakdown}


def gb(nbytes: float) -> float:
    return nbytes / GB


# ---- the cases -----------------------------------------------------------------------------
# A case is one line: model, batch, mesh, mode, dtype and autopar context. A new memory option
# (mixed precision, ZeRO, recomputation: ``plan.memory_options``) is a case whose ``context`` sets
# it when it is a planning input (the prediction then accounts for it), or whose
# ``memory_options`` are written into the plan before building (the plan's memory_per_device must
# then be recomputed for them, or the comparison tests a stale prediction).


@dataclass(frozen=True)
class Case:
    name: str
    model: str                      # key of MODELS
    batch: int
    mesh: tuple                     # mesh shape
    axes: tuple | None = None       # mesh axis names
    mode: str = "auto"
    dtype: str = "fp32"             # the model's own dtype: "fp32" or "bf16" (pure bf16 parameters)
    context: tuple = ()             # (key, value) pairs for autopar.set_auto_parallel_context
    memory_options: tuple = ()      # (field, value) pairs of plan.memory_options
    optimizer: str = "adamw"
    gpu_only: bool = False          # too big for the CPU count (``bench/memory_accuracy.py --cuda`` runs it)

    @property
    def world(self) -> int:
        n = 1
        for s in self.mesh:
            n *= s
        return n


def _models():
    import functools

    from examples.models import GPT, Llama

    return {
        # vocab 2048 x seq 64: the logits are a good part of the activations, as in GPT-2
        "gpt": functools.partial(GPT, vocab=2048, hidden=128, heads=4, layers=2, seq=64),
        "gpt_large": functools.partial(GPT, vocab=4096, hidden=256, heads=8, layers=4, seq=128),
        # deep and thin (bench/memory_fit.py --cfg deep, fewer layers): row-parallel biases whose
        # gradients are not summed, residual streams redistributed into recomputed layers
        "gpt_deep": functools.partial(GPT, vocab=256, hidden=64, heads=4, layers=6, seq=32),
        "llama": functools.partial(Llama, vocab=2048, hidden=128, heads=4, layers=2, seq=64, ffn=256),
        "gpt2": functools.partial(GPT, vocab=50257, hidden=768, heads=12, layers=12, seq=1024),          # 124M
        "gpt_1.3b": functools.partial(GPT, vocab=50257, hidden=2048, heads=16, layers=24, seq=1024),
    }


_SEQ = {"gpt_deep": 32, "gpt": 64, "gpt_large": 128, "llama": 64, "gpt2": 1024, "gpt_1.3b": 1024}
_VOCAB = {"gpt_deep": 256, "gpt": 2048, "gpt_large": 4096, "llama": 2048, "gpt2": 50257, "gpt_1.3b": 50257}

CASES = {c.name: c for c in [
    Case("gpt dp2 fp32", "gpt", 8, (2,), mode="data"),
    Case("gpt tp2 fp32", "gpt", 8, (2,), ("tp",)),
    Case("gpt dp2 bf16 params", "gpt", 8, (2,), mode="data", dtype="bf16"),
    Case("llama dp2xtp2 fp32", "llama", 8, (2, 2), ("dp", "tp")),
    Case("gpt pp2 1f1b m4", "gpt", 8, (2,), ("pp",), context=(("schedule", "1f1b"), ("microbatches", 4))),
    Case("gpt pp2 gpipe m4", "gpt", 8, (2,), ("pp",), context=(("schedule", "gpipe"), ("microbatches", 4))),
    Case("gpt pp2xdp2 1f1b m4", "gpt", 8, (2, 2), ("pp", "dp"), context=(("schedule", "1f1b"), ("microbatches", 4))),
    Case("gpt-large dp2 fp32", "gpt_large", 8, (2,), mode="data"),
    Case("gpt dp2 accumulation 2", "gpt", 8, (2,), mode="data", context=(("accumulation", 2),)),
    # one GPU, GPT-2 124M / 1.3B at batch 8 x 1024 (the H100 data points)
    Case("gpt2-124m bf16 1gpu", "gpt2", 8, (1,), mode="stand_alone", dtype="bf16", gpu_only=True),
    Case("gpt2-124m fp32 1gpu", "gpt2", 8, (1,), mode="stand_alone", gpu_only=True),
    Case("gpt-1.3b bf16 1gpu", "gpt_1.3b", 8, (1,), mode="stand_alone", dtype="bf16", gpu_only=True),
    Case("gpt-1.3b fp32 1gpu", "gpt_1.3b", 8, (1,), mode="stand_alone", gpu_only=True),
    # memory options, set as planning inputs (the prediction accounts for them)
    Case("gpt dp2 bf16 mixed", "gpt", 8, (2,), mode="data", context=(("mixed_precision", "bf16"),)),
    Case("gpt dp2 zero1", "gpt", 8, (2,), mode="data", context=(("zero", 1),)),
    Case("gpt dp2 zero2 accumulation 2", "gpt", 8, (2,), mode="data", context=(("zero", 2), ("accumulation", 2))),
    Case("gpt dp2 zero3", "gpt", 8, (2,), mode="data", context=(("zero", 3),)),
    Case("gpt dp2 recompute full", "gpt", 8, (2,), mode="data", context=(("recompute", "full"),)),
    Case("gpt dp2 recompute selective", "gpt", 8, (2,), mode="data", context=(("recompute", "selective"),)),
    # memory_fit's plan at 2.7x (RESULTS §8i: predicted 4 % under the cap, live 1.7 % over it): tied
    # embedding, tensor parallel, ZeRO-1 over the replicated weights, accumulation, recomputation
    Case("gpt tp4 zero1 accumulation 4 recompute full", "gpt", 16, (4,), ("tp",),
         context=(("zero", 1), ("accumulation", 4), ("recompute", "full"))),
    Case("gpt-deep tp4 zero1 accumulation 2 recompute full", "gpt_deep", 8, (4,), ("tp",),
         context=(("zero", 1), ("accumulation", 2), ("recompute", "full"))),
    Case("gpt-deep dp4 zero3 accumulation 2 recompute full", "gpt_deep", 8, (4,), ("dp",), mode="data",
         context=(("zero", 3), ("accumulation", 2), ("recompute", "full"))),
]}


def case_batch(case: Case):
    g = torch.Generator().manual_seed(1)
    vocab, seq = _VOCAB[case.model], _SEQ[case.model]
    x = torch.randint(1, vocab, (case.batch, seq), generator=g)
    y = torch.randint(0, vocab, (case.batch, seq), generator=g)
    return x, y


def build_case(case: Case, device: str = "cpu", preset: str | None = None):
    """(pmodel, optimizer, x, y) on this rank (call on every rank of ``case.world``); ``preset``:
    the mesh's device preset for planning (default "cpu" on CPU, else $AUTOPAR_BENCH_PRESET or h100)."""
    import os

    import dataclasses

    import autopar
    from examples.models import lm_loss

    autopar.reset_auto_parallel_context()
    if case.context:
        autopar.set_auto_parallel_context(**dict(case.context))
    torch.manual_seed(0)
    model = _models()[case.model]()
    if case.dtype == "bf16":
        model = model.to(torch.bfloat16)
    model = model.to(device)
    x, y = (t.to(device) for t in case_batch(case))
    preset = preset or ("cpu" if device == "cpu" else os.environ.get("AUTOPAR_BENCH_PRESET", "h100"))
    mesh = autopar.Mesh(case.mesh, axis_names=case.axes, device=preset)
    kw = {}
    if case.memory_options:
        plan = autopar.plan(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, mode=case.mode)
        plan.memory_options = dataclasses.replace(plan.memory_options, **dict(case.memory_options))
        kw["plan"] = plan
    pmodel = autopar.parallelize(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                                 mode=None if kw else case.mode, **kw)
    params = [p for p in pmodel.parameters() if p.requires_grad]
    if case.optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=False)
    else:
        opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    return pmodel, opt, x, y


def run_case(rank: int, name: str) -> dict:
    """One rank's measured count and the plan's prediction for it (picklable job for run_ranks)."""
    case = CASES[name]
    pmodel, opt, x, y = build_case(case)
    count = measure_step(pmodel, opt, (x,), y, steps=2)

    def step():
        pmodel.step(x, target=y)
        opt.step()
        opt.zero_grad()
    opt.zero_grad()                 # a training loop's set_to_none: no gradients between steps
    live = live_peak(step, pmodel, opt, x, y)
    return {"case": name, "rank": rank, "measured": {**count.as_dict(), "live": live},
            "predicted": predicted(pmodel.plan, rank),
            "plan": {"degrees": pmodel.plan.degrees, "microbatches": pmodel.plan.microbatches,
                     "schedule": pmodel.plan.schedule}}
