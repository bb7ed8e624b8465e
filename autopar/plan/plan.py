"""The Plan: plain data, the only contract between deciding (solver) and doing (passes).

Everything here is JSON-serialisable; ``Plan.from_json(plan.to_json()) == plan``.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from autopar.core.context import ParallelMode
from autopar.core.mesh import Mesh
from autopar.sharding.placements import Spec, as_spec
from autopar.plan.degree_keys import full_degrees
from autopar.plan.views import view

FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)   # 1: pipeline, grad compression etc. lived in ``options``


class PlanError(ValueError):
    """The request cannot be planned as asked, or a plan does not fit the graph; the message says what to change."""


class CandidateError(PlanError):
    """One layout violates a constraint of the job (e.g. the batch does not divide over its data-parallel
    size): AUTO drops that candidate with this one-line reason; asked for by the user, it is the error."""


def _specs(value):
    """A Spec, or a list of Specs (None for a non-tensor leaf) from their objects or strings."""
    if value is None:
        return None
    if isinstance(value, list):
        return [None if v is None else as_spec(v) for v in value]
    return as_spec(value)


def _json_specs(value):
    if value is None:
        return None
    if isinstance(value, list):
        return [None if v is None else str(v) for v in value]
    return str(value)


class _Specced:
    """Fields named in ``_SPEC_FIELDS`` hold Specs: strings and tuples given to them (by a
    constructor, a hand edit or JSON) become Specs on assignment."""

    _SPEC_FIELDS: tuple = ()

    def __setattr__(self, name, value):
        if name in self._SPEC_FIELDS:
            value = [as_spec(v) for v in value] if name == "inputs" else _specs(value)
        object.__setattr__(self, name, value)


@dataclass
class NodeDecision(_Specced):
    """The strategy chosen for one op."""

    _SPEC_FIELDS = ("inputs", "output")

    op: str
    strategy: str
    inputs: list[Spec]           # spec per tensor input, e.g. [S(0),R]
    output: object               # Spec, or a list of them for multi-output ops
    local: list                  # per axis: local implementation name or None
    module: str = ""
    time: float = 0.0            # predicted seconds (compute + own collectives), fwd+bwd
    options: list = field(default_factory=list)   # [[strategy name, predicted seconds], ...] for explain()


@dataclass
class ParamDecision(_Specced):
    _SPEC_FIELDS = ("spec",)

    spec: Spec
    shape: list[int]
    dtype: str
    placeholder: str
    aliases: list[str] = field(default_factory=list)
    grad_sync: list[str] = field(default_factory=list)   # axes whose gradient all-reduce runs after backward
    kind: str = "parameter"                              # or "buffer"
    trainable: bool = True                               # a parameter that gets a gradient (not frozen/unused)


@dataclass
class Collective:
    kind: str                    # "all_reduce", "all_gather", ..., "send", "recv" (pipeline p2p)
    bytes: int
    axes: list[str]
    phase: str                   # "fwd", "bwd", "step" or "recompute" (a recomputed region's forward again)
    node: str = ""
    time: float = 0.0
    stages: list[int] = field(default_factory=list)   # pipeline: the stages whose ranks run it (empty: by node)
    in_node: bool = False        # run by the node's own local implementation: its seconds are in the node's time


@dataclass
class Alternative:
    degrees: dict                # every key of plan.degree_keys.DEGREE_KEYS (filled in on construction)
    step_time: float
    memory: float                # peak bytes on the fullest device
    fits: bool
    note: str = ""
    microbatches: int = 1
    schedule: str = "none"
    optimizer_time: float = 0.0  # predicted optimizer-step seconds (part of step_time)
    redundant_axes: list[str] = field(default_factory=list)   # mesh axes on which every rank repeats the work
    memory_options: str = "none"  # MemoryOptions.summary() of the candidate

    def __post_init__(self):
        self.degrees = full_degrees(self.degrees)


@dataclass
class Stage:
    index: int
    nodes: list[str]
    layers: list[str]
    ranks: list[int]
    time: float = 0.0            # predicted seconds of one microbatch's forward + backward
    memory: float = 0.0          # predicted bytes: parameters + in-flight activations
    fwd: float = 0.0             # seconds of one microbatch's forward
    bwd: float = 0.0
    send_time: float = 0.0       # p2p seconds to the next stage


@dataclass
class PipelineInfo:
    """How a pipelined plan runs: the runtime re-traces at ``microbatch_size`` and checks the fingerprint."""

    microbatch_size: int
    microbatch_fingerprint: str
    virtual_stages: int = 1
    bubble_fraction: float = 0.0
    pipeline_time: float = 0.0       # predicted schedule critical path (seconds), before grad sync + optimizer
    sub_mesh: list[int] = field(default_factory=list)   # the mesh inside one stage (the full mesh minus pp)
    free_step: float = 0.0           # the step with the stage cut by time alone (no memory cap), same unit costs


_RECOMPUTE = ("none", "selective", "except_attention", "full")


@dataclass
class MemoryOptions:
    """What a plan uses to fit memory, besides splitting (``plan.memory_options``).

    ``mixed_precision``: None (the model's own dtype), "bf16" or "fp16": 16-bit compute on working
    copies of fp32 master weights, fp32 optimizer state (fp16 adds dynamic loss scaling); gradients reduced in ``reduce_dtype``
    ("fp32" or "bf16"). ``accumulation``: the global batch runs as this many microbatches one
    after another, gradients summed locally and synced once (1: none; not with a pipeline).
    ``zero``: 0-3, ZeRO stage on the data-parallel axes (1 optimizer state sharded, 2 + gradients
    reduce-scattered, 3 + parameters gathered before use). ``recompute``: "none", "selective"
    (attention core), "except_attention" (the layer but its attention core), "full", or {layer name: one
    of those} for a per-layer choice."""

    mixed_precision: str | None = None
    reduce_dtype: str = "fp32"
    accumulation: int = 1
    zero: int = 0
    recompute: str | dict = "none"

    def __post_init__(self):
        if self.mixed_precision not in (None, "bf16", "fp16"):
            raise PlanError(f"mixed_precision={self.mixed_precision!r} is not supported; use None, 'bf16' or 'fp16'")
        if self.reduce_dtype not in ("fp32", "bf16"):
            raise PlanError(f"reduce_dtype={self.reduce_dtype!r} is not supported; use 'fp32' or 'bf16'")
        if not isinstance(self.accumulation, int) or self.accumulation < 1:
            raise PlanError(f"accumulation={self.accumulation!r} must be a positive int (1: no accumulation)")
        if self.zero not in (0, 1, 2, 3):
            raise PlanError(f"zero={self.zero!r} is not a ZeRO stage; use 0, 1, 2 or 3")
        choices = self.recompute.values() if isinstance(self.recompute, dict) else [self.recompute]
        bad = [c for c in choices if c not in _RECOMPUTE]
        if bad:
            raise PlanError(f"recompute={bad[0]!r} is not known; use one of {', '.join(_RECOMPUTE)} "
                            "(or a {layer name: choice} mapping)")

    def recompute_for(self, layer: str) -> str:
        """The recomputation chosen for ``layer`` ("none" for a layer the mapping leaves out)."""
        return self.recompute.get(layer, "none") if isinstance(self.recompute, dict) else self.recompute

    def summary(self) -> str:
        """One line for reports, e.g. "bf16 (reduce fp32), ZeRO-1, accumulation 4, recompute full"."""
        parts = []
        if self.mixed_precision:
            parts.append(f"{self.mixed_precision} (reduce {self.reduce_dtype})")
        if self.zero:
            parts.append(f"ZeRO-{self.zero}")
        if self.accumulation > 1:
            parts.append(f"accumulation {self.accumulation}")
        if isinstance(self.recompute, dict):
            used = sorted({v for v in self.recompute.values() if v != "none"})
            if used:
                n = sum(v != "none" for v in self.recompute.values())
                parts.append("recompute " + "/".join(used) + f" on {n} layer{'s' if n != 1 else ''}")
        elif self.recompute != "none":
            parts.append(f"recompute {self.recompute}")
        return ", ".join(parts) or "none"


@dataclass
class MicrobatchTrace:
    """The graph a plan with ``memory_options.accumulation`` > 1 was solved on: the step traced at
    ``size`` rows (the runtime re-traces at it and checks the fingerprint)."""

    size: int
    fingerprint: str


@dataclass
class AutotuneTrial:
    """One measured candidate of autotuning (``measured`` None: it failed or did not run)."""

    label: str
    predicted: float
    measured: float | None = None
    steps: int = 0
    error: str = ""
    chosen: bool = False


# options keys of format 1 that became typed Plan fields
_MOVED_OPTIONS = ("grad_compression", "optimizer", "memory_budget", "optimizer_time", "grad_sync_overhead",
                  "candidate", "axis_shares", "autotune_timing")


@dataclass
class Plan:
    mode: ParallelMode
    mesh: Mesh
    degrees: dict
    axis_roles: dict[str, str] = field(default_factory=dict)   # mesh axis -> "dp" | "tp" | "pp" | "none"
    nodes: dict[str, NodeDecision] = field(default_factory=dict)
    params: dict[str, ParamDecision] = field(default_factory=dict)
    inputs: dict[str, Spec] = field(default_factory=dict)      # input placeholder -> spec
    outputs: dict[str, object] = field(default_factory=dict)   # "loss" -> Spec; "output" -> Spec per leaf
    microbatches: int = 1
    schedule: str = "none"
    stages: list[Stage] = field(default_factory=list)
    step_time: float = 0.0
    flops: float = 0.0
    memory_per_device: list[float] = field(default_factory=list)
    memory_breakdown: dict = field(default_factory=dict)
    solve_time: float = 0.0
    solver_status: str = ""
    alternatives: list[Alternative] = field(default_factory=list)
    memory_bound: bool = False   # the memory cap shaped the layout (without it a faster one was found)
    step_floor: float = 0.0      # proven: no layout of this mesh and step is faster at any memory budget
                                 # (the solve's unbudgeted bound; 0 where none was proven)
    unknown_ops: dict[str, str] = field(default_factory=dict)
    fingerprint: str = ""
    collective_list: list[Collective] = field(default_factory=list)
    pipeline: PipelineInfo | None = None         # set when degrees["pp"] > 1
    memory_options: MemoryOptions = field(default_factory=MemoryOptions)
    accumulation_trace: MicrobatchTrace | None = None   # set when memory_options.accumulation > 1
    grad_compression: str | None = None          # dtype gradients are all-reduced in ("bf16", "fp16")
    compiled: bool = False                       # per-rank programs run through torch.compile; compute was
                                                 # costed at the device's compiled_speedup
    optimizer: str = "adamw"                     # the optimizer the step time was costed for
    memory_budget: float | None = None           # bytes per device the plan was fitted to
    optimizer_time: float | None = None          # predicted optimizer seconds on the fullest rank
    grad_sync_overhead: float = 0.0              # seconds of the last gradient bucket (not overlapped)
    once_per_step_time: float | None = None      # seconds of step_time run once per step however many
                                                 # microbatches (grad sync, optimizer, ZeRO-1/2 gathers)
    candidate: str = ""                          # which search candidate this is, e.g. "DDP layout"
    search_note: str = ""                        # how the search ended when cut short (a time budget)
    axis_shares: dict = field(default_factory=dict)   # mesh axis -> {"dp"|"tp"|"none": share of work}
    autotune: list[AutotuneTrial] = field(default_factory=list)
    autotune_timing: str = ""
    options: dict = field(default_factory=dict)  # free-form solver diagnostics; nothing downstream reads them

    def __post_init__(self):
        self.degrees = full_degrees(self.degrees)    # "ep", "cp" (and any key a caller left out) are 1 where unused

    # ---- queries ---------------------------------------------------------------------
    def collectives(self, rank: int = 0) -> list[Collective]:
        """What one training step runs on ``rank``: kind, bytes, mesh axes, phase.

        A pipelined plan lists one microbatch's activation collectives (entries whose node is an
        op of ``self.nodes`` run once per microbatch), including the sends and receives between
        stages; an entry naming ``stages`` runs on the ranks that hold one of them (once per rank),
        any other on the ranks holding its node's stage."""
        if not self.stages:
            return list(self.collective_list)
        held = [s for s in self.stages if rank in s.ranks] or self.stages[:1]   # interleaved: several
        names = {n for s in held for n in s.nodes}
        mine = {s.index for s in held}
        return [c for c in self.collective_list
                if (mine.intersection(c.stages) if c.stages else
                    not c.node or c.node in names or c.node not in self.nodes or c.phase == "step")]

    def runs_per_step(self, c: Collective) -> int:
        """How many times one step runs entry ``c``: a pipeline's activation collectives once per
        microbatch; with accumulation k, everything but the gradient sync k times (ZeRO-2 and -3
        reduce-scatter gradients in every microbatch too; only the step's all-gather runs once)."""
        if self.stages:
            return self.microbatches if c.node in self.nodes else 1
        k = self.memory_options.accumulation
        if k > 1 and (c.node not in {d.placeholder for d in self.params.values()}
                      or self.memory_options.zero >= 2 and c.phase != "step"):
            return k
        return 1

    def redundant_axes(self) -> list[str]:
        """Mesh axes (size > 1) on which no op is split: every rank on such an axis repeats the same work."""
        size = dict(zip(self.mesh.axis_names, self.mesh.shape))
        return [a for a, role in self.axis_roles.items() if role == "none" and size.get(a, 1) > 1]

    def output_specs(self) -> list:
        """One spec per leaf of the model's output (None for a non-tensor leaf); a plan written when
        ``outputs["output"]`` was a single spec reads as one leaf."""
        specs = self.outputs.get("output")
        if specs is None:
            return []
        return [specs] if isinstance(specs, Spec) else list(specs)

    def explain(self, name: str) -> str:
        """Why a node or parameter got its placement (rendered by ``autopar.report``)."""
        return view("explain")(self, name)

    def save_timeline(self, path) -> Path:
        """Draw the pipeline schedule with predicted stage times as a PNG (needs matplotlib)."""
        return view("save_timeline")(self, path)

    def save_pictures(self, folder) -> list[Path]:
        """Write the plan's pictures (memory per device, alternatives, pipeline timeline: those that
        apply) as PNGs into ``folder``; returns their paths. Needs matplotlib (``autopar[plot]``)."""
        return view("save_pictures")(self, folder)

    def report(self) -> str:
        """The human-readable plan report (rendered by ``autopar.report``)."""
        return view("report")(self)

    # ---- JSON ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-ready: placements written as strings ("[S(0),R]")."""
        d = asdict(replace(self, nodes={}, params={}, inputs={}, outputs={}))
        d["nodes"] = {k: {**asdict(replace(v, inputs=[], output=None)), "inputs": [str(s) for s in v.inputs],
                          "output": _json_specs(v.output)} for k, v in self.nodes.items()}
        d["params"] = {k: {**asdict(replace(v, spec=None)), "spec": str(v.spec)} for k, v in self.params.items()}
        d["inputs"] = {k: str(v) for k, v in self.inputs.items()}
        d["outputs"] = {k: _json_specs(v) for k, v in self.outputs.items()}
        d["mode"] = self.mode.value
        d["mesh"] = self.mesh.to_dict()
        d["format_version"] = FORMAT_VERSION
        return d

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        d = dict(d)
        if "format_version" not in d:
            keys = ", ".join(repr(k) for k in list(d)[:6]) or "none"
            raise NotAPlanError(f"a JSON object without 'format_version' (its keys: {keys}); pass a plan JSON "
                                "written by Plan.save or autopar plan --out")
        version = d.pop("format_version", None)
        if version not in _READABLE_VERSIONS:
            raise ValueError(f"plan format version {version} is not supported (expected {FORMAT_VERSION}); "
                             "make the plan again with this autopar version")
        d["mode"] = ParallelMode.parse(d["mode"])
        d["mesh"] = Mesh.from_dict(d["mesh"])
        d["nodes"] = {k: NodeDecision(**v) for k, v in d["nodes"].items()}
        d["params"] = {k: ParamDecision(**v) for k, v in d["params"].items()}
        d["alternatives"] = [Alternative(**a) for a in d["alternatives"]]
        d["stages"] = [Stage(**s) for s in d["stages"]]
        d["inputs"] = {k: as_spec(v) for k, v in d["inputs"].items()}
        d["outputs"] = {k: _specs(v) for k, v in d["outputs"].items()}
        d["collective_list"] = [Collective(**c) for c in d["collective_list"]]
        if version == 1:
            _upgrade_v1(d)
        if d.get("pipeline") is not None:
            d["pipeline"] = PipelineInfo(**d["pipeline"])
        d["autotune"] = [AutotuneTrial(**t) for t in d.get("autotune", [])]
        d["memory_options"] = MemoryOptions(**d.get("memory_options", {}))
        if d.get("accumulation_trace") is not None:
            d["accumulation_trace"] = MicrobatchTrace(**d["accumulation_trace"])
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        if not text.strip():
            raise NotAPlanError("plan JSON is empty (a plan write that did not finish?); make the plan again")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise NotAPlanError(f"plan JSON is not valid JSON (truncated, or not a plan file): {err}") from None
        if not isinstance(data, dict):
            raise NotAPlanError(f"plan JSON holds a {type(data).__name__}, not a plan (an object written by Plan.save)")
        try:
            return cls.from_dict(data)
        except (KeyError, TypeError, AttributeError) as err:
            raise NotAPlanError(f"plan JSON is not a complete autopar plan ({type(err).__name__}: {err}); make the "
                                "plan again with this autopar version") from None

    def save(self, path) -> None:
        """Write the JSON to ``path`` whole or not at all (a temporary file in the same folder, renamed)."""
        write_atomic(Path(path), self.to_json())

    @classmethod
    def load(cls, path) -> "Plan":
        p = Path(path)
        if p.is_dir():
            raise IsADirectoryError(f"{p} is a folder, not a plan file; pass the plan JSON inside it (autopar plan "
                                    "--out DIR writes DIR/plan.json)")
        if not p.exists():
            raise FileNotFoundError(f"no plan file at {p}")
        try:
            return cls.from_json(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError as err:
            raise NotAPlanError(f"{p} is not an autopar plan: it is not UTF-8 text ({err})") from None
        except NotAPlanError as err:
            raise NotAPlanError(f"{p} is not an autopar plan: {err}") from None
        except ValueError as err:
            raise ValueError(f"cannot read the plan file {p}: {err}") from None

    def __eq__(self, other) -> bool:
        return isinstance(other, Plan) and self.to_dict() == other.to_dict()


class NotAPlanError(ValueError):
    """A file or JSON text that is not an autopar plan (empty, truncated, another JSON document)."""


def write_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` in full, or is left as it was (the text goes to a temporary file first)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _upgrade_v1(d: dict) -> None:
    """Format 1 kept the fields the runtime and report read in ``options``: move them to their fields."""
    options = dict(d.get("options", {}))
    for key in _MOVED_OPTIONS:
        if key in options:
            d[key] = options.pop(key)
    d["pipeline"] = options.pop("pipeline", None)
    d["autotune"] = [{k: t[k] for k in ("label", "predicted", "measured", "steps", "error", "chosen") if k in t}
                     for t in options.pop("autotune", [])]
    d["options"] = options
