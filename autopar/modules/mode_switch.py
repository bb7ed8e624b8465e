"""``pmodel.train()`` / ``pmodel.eval()``: one per-rank program per module mode, the SAME parameters.

The traced program is fixed in the mode it was traced in (``model.training`` of every submodule
decides dropout, batch norm and any ``if self.training`` in a forward). On the first switch to
another mode the model is traced again with every submodule in that mode (``Retracer`` at the
global batch, and at the plan's microbatch for a pipeline or accumulation), and the other-mode
graph is lowered with the SAME plan. The plan's node strategies are keyed by node name, and fx numbers
names per op, so the new graph's ops are first renamed as their counterparts in the graph the plan
was made on, traced again (``align``: same op, module and shape, in order). An eval graph is the
training graph less some ops (batch norm's ``num_batches_tracked += 1``, a ``self.training``
branch) with other constant arguments (``training=False`` in ``batch_norm`` and ``dropout``), so
every op finds its counterpart; an op that has none has no placement, and is refused by name
(``ModeSwitchError``).

What is swapped is only the graphs: a ``RankProgram``'s training and forward-only graphs (with
ZeRO-3's gather modules of the first build, which hold the shards), or a pipeline's executor (its
stage graphs and transfers). Parameters, buffers, gradient sync (DDP, ZeRO) and optimizer state
stay those of the module built first; every graph reads them by name at each call. A mode's
lowered graphs are kept: switching back and forth costs nothing after the first time.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass, field

import torch.fx as fx
import torch.nn as nn

from autopar.graph.chunk_hints import mark_chunk_hints
from autopar.graph.retrace import Retracer, graph_fingerprint, microbatch_trace
from autopar.plan.plan import PlanError
from autopar.runtime.compiled import runner
from autopar.sharding.candidates import is_dropped


class ModeSwitchError(PlanError):
    """``pmodel.train()`` / ``pmodel.eval()`` cannot give the module the asked-for mode."""


def _flags(model: nn.Module) -> tuple[bool, ...]:
    return tuple(m.training for m in model.modules())


@contextlib.contextmanager
def _model_mode(model: nn.Module, flags: tuple[bool, ...]):
    """Every submodule of ``model`` in the mode ``flags`` gives it, its own flags restored after."""
    mods = list(model.modules())
    old = [m.training for m in mods]
    try:
        for m, f in zip(mods, flags):
            m.training = f
        yield
    finally:
        for m, f in zip(mods, old):
            m.training = f


@dataclass
class _Installed:
    """What runs one mode: a RankProgram's graphs, or a pipeline's executor."""

    graph: object = None
    forward: object = None
    runs: dict | None = None
    executor: object = None


@dataclass
class ModePrograms:
    """The programs of a module by mode (``flags``: each submodule's ``training``, in ``modules()`` order)."""

    model: nn.Module
    retracer: Retracer | None
    build: object                        # (model, traced, plan, retracer) -> a module of the same kind
    current: tuple[bool, ...]
    built_in: tuple[bool, ...]           # the mode the plan's graph was traced in
    programs: dict = field(default_factory=dict)

    def switch(self, pmodel, mode: bool) -> None:
        flags = tuple(mode for _ in self.current)
        if flags == self.current:
            return
        if flags not in self.programs:
            self.programs[flags] = self._lower(pmodel, flags)
        _install(pmodel, self.programs[flags])
        self.current = flags

    def _lower(self, pmodel, flags) -> _Installed:
        if self.retracer is None:
            raise ModeSwitchError("pmodel.train()/eval(): this module was built without a Retracer, so it cannot "
                                  "trace the model in another mode; build it through autopar.parallelize()")
        what = "eval" if not any(flags) else "train"
        retracer = _ModeRetracer(self.retracer, self.model, flags)
        full = retracer(pmodel.global_batch_size)
        mark_chunk_hints(full.gm)
        plan = _plan_for(pmodel.plan, full, retracer, _ModeRetracer(self.retracer, self.model, self.built_in), what)
        other = self.build(self.model, full, plan, retracer)
        return _take(pmodel, other, what)


class _ModeRetracer:
    """``base`` (a Retracer) tracing with every submodule of ``model`` in the mode ``flags`` gives it."""

    def __init__(self, base: Retracer, model: nn.Module, flags: tuple):
        self.base, self.model, self.flags = base, model, flags

    def __call__(self, batch: int):
        with _model_mode(self.model, self.flags):
            return self.base(batch)


def _plan_for(plan, full, retracer, base, what: str):
    """``plan`` for the other mode's graph (the global one, or the microbatch one of a pipeline or
    accumulation): its nodes renamed as their counterparts in the graph the plan was made on (``base``
    traces it again, ``align``), checked to be ops the plan places (``check_mappable``), and the
    plan's fingerprint made that of this graph."""
    if plan.pipeline is not None and plan.degrees.get("pp", 1) > 1:
        size = plan.pipeline.microbatch_size
    elif plan.memory_options.accumulation > 1 and plan.accumulation_trace is not None:
        size = plan.accumulation_trace.size
    else:
        size = None
    gm = microbatch_trace(full, size, retracer, rescale=False).gm if size is not None else full.gm
    align(gm, base(size if size is not None else full.batch_size).gm, what)
    check_mappable(gm, plan, what)
    fp = graph_fingerprint(gm)
    if plan.pipeline is not None and plan.degrees.get("pp", 1) > 1:
        return dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, microbatch_fingerprint=fp))
    if size is not None:
        return dataclasses.replace(plan, accumulation_trace=dataclasses.replace(plan.accumulation_trace,
                                                                                fingerprint=fp))
    return plan


def _key(node: fx.Node) -> tuple:
    return str(node.target), node.meta.get("module_path", "")


def _shape(node: fx.Node):
    """The shapes of the op's output and of its node inputs (a strategy is valid for these)."""
    def one(n):
        v = n.meta.get("val")
        return tuple(v.shape) if hasattr(v, "shape") else None
    return one(node), tuple(one(a) for a in node.all_input_nodes)


def align(gm: fx.GraphModule, base: fx.GraphModule, what: str) -> None:
    """Rename the ops of ``gm`` (one mode's trace) as their counterparts in ``base`` (the other mode's):
    within each (op, module), ``gm``'s ops in order are matched to the next of ``base``'s with the same
    output and input shapes (a mode drops ops, e.g. batch norm's counter update; fx numbers names per
    op, so the names after a dropped op shift). Where a dropped op had the same op, module and shapes
    as a kept one, the kept one may take the dropped one's strategy: still a strategy valid for it,
    and the lowering reshards every edge its placements need, so the program stays exact. An op with
    no counterpart is refused (``ModeSwitchError``)."""
    pending: dict[tuple, list] = {}
    for n in base.graph.nodes:
        if n.op == "call_function":
            pending.setdefault(_key(n), []).append(n)
    mapping = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        queue = pending.get(_key(n), [])
        while queue and _shape(queue[0]) != _shape(n):
            queue.pop(0)
        if not queue:
            _refuse(n, what, "that the graph the plan was made for does not have")
        mapping[n] = queue.pop(0).name
    space = gm.graph._graph_namespace      # fx keeps a name once used: the freed names are released here
    kept = {n.name for n in gm.graph.nodes if n not in mapping}
    clash = kept & set(mapping.values())
    if clash:
        raise ModeSwitchError(f"pmodel.{what}(): the {what}-mode graph has inputs named like ops of the other "
                              f"graph ({sorted(clash)[:3]}); make a new plan")
    space._used_names.difference_update(n.name for n in mapping)
    for n, name in mapping.items():
        n.name = name
        space._rename_object(n, name)
    gm.recompile()


def _refuse(node: fx.Node, what: str, had: str):
    where = node.meta.get("module_path") or "<root>"
    raise ModeSwitchError(
        f"pmodel.{what}(): the model's {what}-mode graph runs {node.target} (node {node.name!r}, in module "
        f"{where!r}), an op {had}; autopar lowers the other mode with the "
        f"same plan, matching each op to its counterpart, so a forward that takes another code path in {what} "
        "mode (beyond leaving ops out, as dropout and batch norm do) cannot be mapped. Make both modes run the "
        "same ops (e.g. multiply by a 0/1 factor instead of branching on self.training), or parallelize a copy "
        f"of the model put in {what} mode for that use")


def check_mappable(gm: fx.GraphModule, plan, what: str) -> None:
    """Every op of the ``what``-mode graph is one the plan places: same node name, same op."""
    import operator

    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem or is_dropped(node):
            continue
        d = plan.nodes.get(node.name)
        if d is None or d.op != str(node.target):
            _refuse(node, what, f"that the plan places as {d.op}" if d is not None else "that the plan does not place")


def _take(pmodel, other, what: str) -> _Installed:
    """The graphs of ``other`` (built on the other mode's trace) to run on ``pmodel``'s parameters."""
    pipelined = hasattr(other, "_executor")
    slots = [s for call in other._executor.stages.values() for s in call.slots] if pipelined else other.program._slots
    missing = sorted({ref for kind, ref in slots if kind in ("param", "buffer") and not pmodel.program.has(ref)})
    if missing:
        raise ModeSwitchError(f"pmodel.{what}(): the {what}-mode program of this rank reads {missing[:3]}, which this "
                              "rank does not hold in the other mode; make both modes use the same parameters")
    if pipelined:
        return _Installed(executor=other._executor)
    prog, mine = other.program, pmodel.program
    graph, fwd = prog._autopar_graph, prog._autopar_forward
    _share_zero3(graph, fwd, mine._autopar_graph, what)
    compiled = pmodel.plan.compiled
    return _Installed(graph=graph, forward=fwd, runs={False: runner(graph, compiled), True: runner(fwd, compiled)})


def _share_zero3(graph: fx.GraphModule, fwd: fx.GraphModule, mine: fx.GraphModule, what: str) -> None:
    """ZeRO-3: the other graph's gather modules replaced by the first build's (they hold this rank's shards)."""
    ours = {n: m for n, m in mine.named_children() if n.startswith("zero3_gather_")}
    for gm in (graph, fwd):
        for name, mod in list(gm.named_children()):
            if not name.startswith("zero3_gather_"):
                continue
            if name not in ours or list(ours[name].names) != list(mod.names):
                raise ModeSwitchError(f"pmodel.{what}(): ZeRO-3 gathers the parameters in another grouping in "
                                      f"{what} mode ({name}); make a new plan without ZeRO-3 for this model")
            setattr(gm, name, ours[name])


def _current(pmodel) -> _Installed:
    if hasattr(pmodel, "_executor"):
        return _Installed(executor=pmodel._executor)
    p = pmodel.program
    return _Installed(graph=p._autopar_graph, forward=p._autopar_forward, runs=p._runs)


def _install(pmodel, inst: _Installed) -> None:
    if inst.executor is not None:
        pmodel._executor = inst.executor
        return
    p = pmodel.program
    p._autopar_graph, p._autopar_forward, p._runs = inst.graph, inst.forward, inst.runs


def storage_free(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device: what tracing it in another
    mode needs (shapes, dtypes, structure) without holding its weights. ``pmodel`` trains its own
    tensors, so the user's ``del model`` frees the whole model's memory. Tensors that are plain
    attributes (not parameters or buffers: traced in as constants) are copied with their values."""
    memo: dict = {}
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in memo:
            m = t.detach().to("meta")
            memo[id(t)] = nn.Parameter(m, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else m
    try:
        return copy.deepcopy(model, memo)
    except (TypeError, RuntimeError, copy.Error):     # an attribute that cannot be copied: keep the model
        return model


def attach(pmodel, model: nn.Module, retracer: Retracer | None, build) -> None:
    """Record ``pmodel``'s programs as those of ``model``'s present mode (``pmodel.training`` follows it).
    What is kept to trace the other mode later is ``storage_free(model)``, not ``model``."""
    flags = _flags(model)
    skeleton = storage_free(model)
    if retracer is not None:
        retracer = dataclasses.replace(retracer, model=skeleton)
    modes = ModePrograms(skeleton, retracer, build, flags, flags)
    modes.programs[flags] = _current(pmodel)
    object.__setattr__(pmodel, "_modes", modes)
    pmodel.training = model.training


def switch(pmodel, mode: bool) -> None:
    """Give ``pmodel`` the programs of ``mode`` (every submodule ``training=mode``), lowering them once."""
    modes = getattr(pmodel, "_modes", None)
    if modes is not None:
        modes.switch(pmodel, bool(mode))
