"""Random training jobs for the property of ``fuzz_check.py`` (tests/ranks/test_fuzz.py, bench/fuzz.py).

A ``Case`` is plain, picklable data: a model spec (``fuzz_models``), the global batch, a mesh (1, 2
or 4 ranks; 1-D or 2-D, axes unnamed or named from dp/tp/pp), a parallel mode, the memory options
(ZeRO stage, recomputation, accumulation, mixed precision; ``None`` = the solver's choice), a
memory cap that makes AUTO / SEMI_AUTO split, shard or recompute to fit (as users meet it), the
optimizer, user-level accumulation (``micro`` step() calls per optimizer step), clipping, and
SEMI_AUTO annotations (weight placements, pipeline stage tags). HYBRID cases apply a plan made by
``autopar.plan`` in another mode (``source``), passed as JSON.

Most cases are drawn to train (7 in 8): their combinations avoid what autopar refuses by its
documented rules (ZeRO or accumulation with a pipeline, ZeRO on one device, a batch or a sharded
dim the devices do not divide, two annotations of one weight, fewer layers than pipeline stages),
since a refusal tests only its message. The rest are ``wild``: those combinations are drawn on
purpose and must be refused by autopar's own error (``fuzz_check.py``).

What every case keeps, and why:

* ``micro`` divides the batch: ``oracle.reference_run`` cuts the batch into ``micro`` equal
  micro-batches (a harness rule, not autopar's);
* under mixed precision every micro-batch splits over 2 ranks: the bar there is torch FSDP2 over
  2 ranks on the same job (docs/testing.md), which needs an even split;
* no LayerNorm over 2 features: its output is ±1 whatever the input, so its backward is all
  cancellation, and any reordering of a sum before it (a tensor-parallel matmul summed in two
  halves, in plain torch on one device too) moves the gradients by 1e-2 relative;
* stage tags only where the mesh has a ``pp`` axis and the mode reads annotations (SEMI_AUTO,
  AUTO): elsewhere they are ignored with a warning, which other tests check.
"""
from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass

from hypothesis import strategies as st

from fuzz_models import MLPSpec, TransformerSpec

MODES = ("auto", "semi_auto", "data", "hybrid", "stand_alone")
ACTS = ("relu", "gelu", "tanh", "silu", "identity")
MESHES = {          # ranks -> [(shape, axis names or None)]
    1: [((1,), None), ((1,), ("dp",))],
    2: [((2,), None), ((2,), ("dp",)), ((2,), ("tp",)), ((2,), ("pp",))],
    4: [((4,), None), ((4,), ("dp",)), ((4,), ("tp",)), ((4,), ("pp",)), ((2, 2), None), ((2, 2), ("dp", "tp")),
        ((2, 2), ("tp", "dp")), ((2, 2), ("pp", "dp")), ((2, 2), ("pp", "tp"))],
}


@dataclass(frozen=True)
class Annotation:
    """``autopar.shard(module, weight={axis: Shard(dim) or Replicate() when dim is None}[, bias=...])``."""
    module: str
    axis: str
    dim: int | None
    bias: bool = False          # shard the bias like the weight's dim 0 (column-parallel)


@dataclass(frozen=True)
class Case:
    model: MLPSpec | TransformerSpec
    batch: int
    shape: tuple[int, ...]
    axis_names: tuple[str, ...] | None
    mode: str
    source: str = ""                                  # HYBRID: the mode its plan was made in
    optim: str = "sgd"
    micro: int = 1
    clip: float | None = None
    zero: int | None = None
    recompute: str | None = None
    accumulation: int | None = None
    mixed_precision: str | None = None
    shards: tuple[Annotation, ...] = ()
    stages: tuple[tuple[str, int], ...] = ()          # pipeline_stage(module, stage)
    memory_fraction: float | None = None              # cap each device at this x the one-device plan's peak
    steps: int = 2

    @property
    def ranks(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def annotated_mode(self) -> str:
        """The mode annotations are read in: the case's own, or for HYBRID the one its plan was made in."""
        return self.source if self.mode == "hybrid" else self.mode

    def replace(self, **kw) -> "Case":
        return dataclasses.replace(self, **kw)

    def describe(self) -> str:
        """One line a person can paste into ``Case(...)`` to replay it (``fuzz_check.check_case``)."""
        return repr(self)


def layer_count(spec) -> int:
    return len(spec.widths) if spec.family == "mlp" else spec.layers


def layer_names(spec) -> list[str]:
    container = "layers" if spec.family == "mlp" else "blocks"
    return [f"{container}.{i}" for i in range(layer_count(spec))]


def linear_modules(spec) -> list[str]:
    """Modules with a 2-D weight an annotation may place (globs over the repeated layers)."""
    if spec.family == "mlp":
        return [f"layers.{i}.fc" for i in range(len(spec.widths))] + ["layers.*.fc", "head"]
    qkv = ["blocks.*.qkv"] if spec.fused_qkv else ["blocks.*.q", "blocks.*.k", "blocks.*.v"]
    return qkv + ["blocks.*.proj", "blocks.*.fc1", "blocks.*.fc2", "blocks.0.fc1", "lm_head", "wte"]


@st.composite
def mlp_specs(draw, min_depth: int = 1) -> MLPSpec:
    depth = draw(st.integers(min_depth, 4))
    widths = tuple(draw(st.lists(st.sampled_from([4, 6, 8, 12, 16, 32]), min_size=depth, max_size=depth)))
    acts = tuple(draw(st.lists(st.sampled_from(ACTS), min_size=depth, max_size=depth)))
    bias = tuple(draw(st.lists(st.booleans(), min_size=depth, max_size=depth)))
    return MLPSpec(d_in=draw(st.sampled_from([3, 8, 16])), widths=widths, acts=acts, bias=bias,
                   classes=draw(st.sampled_from([2, 5, 10])), head_bias=draw(st.booleans()))


@st.composite
def transformer_specs(draw, min_layers: int = 1) -> TransformerSpec:
    heads = draw(st.sampled_from([1, 2, 4]))
    hidden = heads * draw(st.sampled_from([2, 4, 8]))
    norm = draw(st.sampled_from(["layer", "rms"]))
    if norm == "layer" and hidden < 4:
        hidden = 4                  # LayerNorm over 2 features is ill-conditioned (module docstring)
    return TransformerSpec(vocab=draw(st.sampled_from([11, 16, 32, 50])), seq=draw(st.integers(2, 8)), hidden=hidden,
                           heads=heads, ffn=draw(st.sampled_from([8, 12, 16, 32])),
                           layers=draw(st.integers(min_layers, max(3, min_layers))), tied=draw(st.booleans()),
                           fused_qkv=draw(st.booleans()), bias=draw(st.booleans()), norm=norm,
                           act=draw(st.sampled_from(["gelu", "relu", "silu"])))


def weights(spec) -> dict[str, tuple[int, int]]:
    """Module name -> weight shape of every module an annotation may place (a tied head under both names)."""
    if spec.family == "mlp":
        dims = (spec.d_in,) + spec.widths
        out = {f"layers.{i}.fc": (dims[i + 1], dims[i]) for i in range(len(spec.widths))}
        return out | {"head": (spec.classes, spec.widths[-1])}
    h, out = spec.hidden, {"lm_head": (spec.vocab, spec.hidden), "wte": (spec.vocab, spec.hidden)}
    for i in range(spec.layers):
        parts = {"qkv": (3 * h, h)} if spec.fused_qkv else {"q": (h, h), "k": (h, h), "v": (h, h)}
        parts |= {"proj": (h, h), "fc1": (spec.ffn, h), "fc2": (h, spec.ffn)}
        out |= {f"blocks.{i}.{k}": v for k, v in parts.items()}
    return out


def _targets(spec, module: str) -> set[str]:
    """The weights an annotation of ``module`` (a glob) places; a tied head and embedding are one."""
    names = {n for n in weights(spec) if fnmatch.fnmatchcase(n, module)}
    return {"lm_head" if spec.family == "transformer" and spec.tied and n == "wte" else n for n in names}


def _fits(spec, a: Annotation, sizes: dict[str, int]) -> bool:
    """Every placed weight divides along the sharded dim (a bias along dim 0)."""
    if a.dim is None:
        return True
    return all(weights(spec)[n][a.dim] % sizes[a.axis] == 0 for n in _targets(spec, a.module))


@st.composite
def annotations(draw, spec, sizes: dict[str, int], wild: bool) -> tuple[Annotation, ...]:
    """Up to 3 weight placements over the non-pipeline axes (``sizes``: axis -> size): a Megatron pair,
    single shards, replicas. Unless ``wild``, no two place one weight and every shard divides its dim;
    ``wild`` ones may conflict or not divide (autopar's errors)."""
    axes = sorted(sizes)
    if not axes:
        return ()
    out = []
    if draw(st.booleans()):                     # Megatron's MLP split: column- then row-parallel
        axis = draw(st.sampled_from(axes))
        if spec.family == "transformer":
            out += [Annotation("blocks.*.fc1", axis, 0, draw(st.booleans()) and spec.bias),
                    Annotation("blocks.*.fc2", axis, 1)]
        elif len(spec.widths) >= 2:
            i = draw(st.integers(0, len(spec.widths) - 2))
            out += [Annotation(f"layers.{i}.fc", axis, 0, draw(st.booleans()) and spec.bias[i]),
                    Annotation(f"layers.{i + 1}.fc", axis, 1)]
    for _ in range(draw(st.integers(0 if out else 1, 2))):
        out.append(Annotation(draw(st.sampled_from(linear_modules(spec))), draw(st.sampled_from(axes)),
                              draw(st.sampled_from([0, 1, None])), False))
    if wild:
        return tuple(dict.fromkeys(out))
    kept, placed = [], set()
    for a in out:
        targets = _targets(spec, a.module)
        if targets and not targets & placed and _fits(spec, a, sizes):
            kept.append(a)
            placed |= targets
    return tuple(kept)


@st.composite
def stage_tags(draw, spec, pp: int, wild: bool) -> tuple[tuple[str, int], ...]:
    """pp - 1 cuts at distinct layers after the first (or none), or when ``wild`` one rule-breaking tag."""
    names = layer_names(spec)
    if wild and draw(st.booleans()):            # a tag that breaks the rule: must be autopar's PlanError
        return ((names[0], 1),) if names else ()
    if len(names) < pp or draw(st.integers(0, 3)) == 0:
        return ()
    cuts = sorted(draw(st.lists(st.integers(1, len(names) - 1), min_size=pp - 1, max_size=pp - 1, unique=True)))
    return tuple((names[c], s + 1) for s, c in enumerate(cuts))


@st.composite
def cases(draw) -> Case:
    """A case; one in 8 is ``wild`` (any accumulation, ZeRO with a pipeline or on one device, batches the
    devices do not divide, conflicting annotations, rule-breaking stage tags: autopar must refuse
    those clearly). The others are drawn so that most train (module docstring)."""
    wild = draw(st.integers(0, 7)) == 0
    ranks = draw(st.sampled_from([4, 2, 4, 2, 1]))
    shape, names = draw(st.sampled_from(MESHES[ranks]))
    axis_names = names or tuple(f"d{i}" for i in range(len(shape)))
    pp = shape[axis_names.index("pp")] if "pp" in axis_names else 1
    least = 1 if wild else pp
    spec = draw(st.one_of(mlp_specs(least), transformer_specs(least)))
    mode = draw(st.sampled_from(MODES + ("semi_auto",)))
    source = draw(st.sampled_from(["auto", "semi_auto", "data"])) if mode == "hybrid" else ""
    mixed = draw(st.sampled_from([None, None, None, "bf16"]))
    micro = draw(st.sampled_from([1, 1, 2]))
    if wild:
        per_step = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    else:
        per_step = (ranks if ranks > 1 else 2) * draw(st.sampled_from([1, 2, 3, 4]))
    if mixed and per_step % 2:
        per_step *= 2                              # FSDP2's bar runs on 2 ranks (module docstring)
    batch = per_step * micro
    split = [k for k in range(1, per_step + 1) if per_step % k == 0 and (wild or (per_step // k) % ranks == 0)]
    accumulation = draw(st.sampled_from([None, None] + (split if wild or pp == 1 else [1])))
    if wild and draw(st.booleans()):
        accumulation = 3                           # may not divide the batch: then autopar's error
    zeros = [None, 0, 1, 2, 3] if wild or (ranks > 1 and pp == 1) else [None, 0]
    case = Case(model=spec, batch=batch, shape=shape, axis_names=names, mode=mode, source=source,
                optim=draw(st.sampled_from(["sgd", "adamw"])), micro=micro, clip=draw(st.sampled_from([None, 0.5])),
                zero=draw(st.sampled_from(zeros)), recompute=draw(st.sampled_from([None, "none", "selective", "full"])),
                accumulation=accumulation, mixed_precision=mixed)
    if case.annotated_mode in ("semi_auto", "auto"):
        case = case.replace(memory_fraction=draw(st.sampled_from([None, None, None, 0.6, 0.35])))
        sizes = {a: s for a, s in zip(axis_names, shape) if a != "pp" and s > 1}
        if case.annotated_mode == "semi_auto" or draw(st.booleans()):
            case = case.replace(shards=draw(annotations(spec, sizes, wild)))
        if pp > 1:
            case = case.replace(stages=draw(stage_tags(spec, pp, wild)))
    return case
