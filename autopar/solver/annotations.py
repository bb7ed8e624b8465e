"""SEMI_AUTO annotations (MindSpore style): parameter and input placements, pipeline stages.

Annotations are recorded process-wide and resolved against a model when it is planned:
module objects are matched by identity, names by ``fnmatch`` globs over module paths.
torch tensor-parallel styles (ColwiseParallel, RowwiseParallel, SequenceParallel) are
translated to weight/bias placements on the ``tp`` axis (or the axis given).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch.nn as nn

from autopar.sharding.placements import Partial, Replicate, Shard, from_torch


@dataclass
class ParamAnnotation:
    target: object                 # module object or glob string
    tensors: dict[str, dict]       # "weight" -> {axis: placement}


@dataclass
class Annotations:
    params: list[ParamAnnotation] = field(default_factory=list)
    inputs: dict[int, dict] = field(default_factory=dict)
    stages: list[tuple[object, int]] = field(default_factory=list)
    ops: list[tuple[str, dict]] = field(default_factory=list)     # (module-path glob, {axis: strategy name})

    def clear(self) -> None:
        self.params.clear()
        self.inputs.clear()
        self.stages.clear()
        self.ops.clear()

    def empty(self) -> bool:
        return not (self.params or self.inputs or self.stages or self.ops)

    def describe(self, limit: int = 4) -> str:
        """The annotations set, as the calls that made them: "shard('layers.0'), pipeline_stage('blocks.3', 1)"."""
        name = lambda t: repr(t) if isinstance(t, str) else f"<{type(t).__name__}>"  # noqa: E731
        calls = ([f"shard({name(a.target)})" for a in self.params] + [f"shard_input({i})" for i in self.inputs]
                 + [f"pipeline_stage({name(m)}, {k})" for m, k in self.stages]
                 + [f"op_strategy({t!r})" for t, _ in self.ops])
        return ", ".join(calls[:limit]) + (f" and {len(calls) - limit} more" if len(calls) > limit else "")


LEFTOVER = ("Annotations stay set until autopar.clear_annotations(): if this one is left from an earlier model, "
            "call autopar.clear_annotations() before annotating this one")


ANNOTATIONS = Annotations()


def _check_placements(where: str, placements: dict) -> dict:
    if not isinstance(placements, dict):
        raise TypeError(f"{where}: placements must be a dict {{axis name: Shard(d)|Replicate()}}, got {placements!r}")
    out = {}
    for ax, p in placements.items():
        p = from_torch(p)
        if isinstance(p, Partial):
            raise ValueError(f"{where}: a parameter or input cannot be Partial on axis {ax!r}; use Shard or Replicate")
        out[str(ax)] = p
    return out


def _style(style, axis: str) -> dict[str, dict]:
    name = type(style).__name__
    if name == "ColwiseParallel":
        return {"weight": {axis: Shard(0)}, "bias": {axis: Shard(0)}}
    if name == "RowwiseParallel":
        return {"weight": {axis: Shard(1)}, "bias": {axis: Replicate()}}
    if name == "SequenceParallel":
        return {"weight": {axis: Replicate()}, "bias": {axis: Replicate()}}
    raise TypeError(f"unsupported tensor-parallel style {name}; use ColwiseParallel, RowwiseParallel, "
                    "SequenceParallel or explicit placements")


def shard(target, axis: str = "tp", **tensors) -> None:
    """Fix placements: ``shard(model.fc1, weight={"tp": Shard(0)})`` or a glob name, or a torch
    parallelize_plan dict ``shard({"layers.*.wq": ColwiseParallel()}, axis="tp")``."""
    if isinstance(target, dict):
        for name, style in target.items():
            ANNOTATIONS.params.append(ParamAnnotation(name, _style(style, axis)))
        return
    if not isinstance(target, (nn.Module, str)):
        raise TypeError(f"shard() takes a module, a module-name glob or a plan dict, got {type(target).__name__}")
    if not tensors:
        raise ValueError("shard() needs at least one tensor placement, e.g. weight={'tp': Shard(0)}")
    checked = {k: _check_placements(f"shard({k}=...)", v) for k, v in tensors.items()}
    ANNOTATIONS.params.append(ParamAnnotation(target, checked))


def shard_input(index: int, placements: dict) -> None:
    """Fix the placement of example input ``index``: ``shard_input(0, {"dp": Shard(0)})``."""
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise TypeError(f"shard_input(index, placements): index is the position of the example input (0, 1, ...), "
                        f"got {index!r}")
    ANNOTATIONS.inputs[int(index)] = _check_placements(f"shard_input({index})", placements)


def pipeline_stage(module, stage: int) -> None:
    """Tag ``module`` (object or dotted name) to start pipeline stage ``stage``."""
    if not isinstance(module, (nn.Module, str)):
        raise TypeError(f"pipeline_stage() takes a module or its dotted name, got {type(module).__name__}")
    if int(stage) < 0:
        raise ValueError(f"pipeline stage must be >= 0, got {stage}")
    ANNOTATIONS.stages.append((module, int(stage)))


def op_strategy(target: str, **axes: str) -> None:
    """SEMI_AUTO: fix, per mesh axis, the strategy of the ops traced inside the modules ``target`` (a module-path
    glob) that have a strategy of that name: ``op_strategy("layers.*.mlp.experts", dp="ep")`` runs every
    experts op there expert-parallel on axis "dp" (the names a rule gives: ``sharding/rules/*.py``)."""
    if not isinstance(target, str):
        raise TypeError(f"op_strategy() takes a module-path glob such as 'layers.*.mlp.experts', got "
                        f"{type(target).__name__}")
    if not axes or not all(isinstance(v, str) for v in axes.values()):
        raise ValueError("op_strategy() needs at least one axis=strategy name, e.g. op_strategy('layers.*.experts', "
                         f"dp='ep'); got {axes!r}")
    ANNOTATIONS.ops.append((target, dict(axes)))


def restrict_op_strategies(traced, cands, mesh, allowed: dict, ann: Annotations = ANNOTATIONS) -> None:
    """Keep, for each op under an ``op_strategy`` target, only the strategies named so on those axes;
    a target matching no op with such a strategy is an error naming what there is."""
    for target, axes in ann.ops:
        for ax in axes:
            if ax not in mesh.axis_names:
                raise ValueError(f"op_strategy({target!r}, {ax}=...): the mesh has no axis {ax!r}; its axes are "
                                 f"{list(mesh.axis_names)}. {LEFTOVER}")
        axes = {ax: want for ax, want in axes.items() if mesh.shape[mesh.axis_index(ax)] > 1}   # size 1: whole
        if not axes:
            continue
        hits = 0
        for node in traced.gm.graph.nodes:
            strategies = cands.strategies.get(node.name)
            path = node.meta.get("module_path", "")
            if not strategies or not fnmatch.fnmatchcase(path, target):
                continue
            keep = [i for i in allowed.get(node.name, range(len(strategies)))
                    if all(strategies[i].name.split("×")[mesh.axis_index(ax)] == want for ax, want in axes.items())]
            if keep:
                allowed[node.name] = keep
                hits += 1
        if not hits:
            raise ValueError(f"op_strategy({target!r}, {', '.join(f'{a}={w!r}' for a, w in axes.items())}) matches no "
                             "op with such a strategy; check the module path (plan.nodes[...].module) and the strategy names "
                             "in autopar/sharding/rules/; a strategy is offered only where its splits divide evenly "
                             f"(e.g. the expert count by the size of the axis that splits the experts). {LEFTOVER}")


def clear_annotations() -> None:
    ANNOTATIONS.clear()


def resolve_params(model: nn.Module, ann: Annotations) -> dict[str, dict]:
    """Parameter name -> {axis: placement}; errors on conflicts and unmatched targets."""
    names = {id(m): n for n, m in model.named_modules()}
    modules = dict(model.named_modules())
    out: dict[str, dict] = {}
    for a in ann.params:
        if isinstance(a.target, nn.Module):
            if id(a.target) not in names:
                raise ValueError(f"shard() was given a module object ({type(a.target).__name__}) that is not part of "
                                 f"the model being planned. {LEFTOVER}")
            matched = [names[id(a.target)]]
        else:
            matched = [n for n in modules if fnmatch.fnmatchcase(n, a.target)]
            if not matched:
                raise ValueError(f"shard({a.target!r}) matches no module of the model; module names look like "
                                 f"{list(modules)[1:4]}. {LEFTOVER}")
        for mname in matched:
            mod = modules[mname]
            for leaf, placements in a.tensors.items():
                if getattr(mod, leaf, None) is None:
                    if isinstance(a.target, str) and leaf == "bias":
                        continue
                    raise ValueError(f"module {mname or '<root>'!r} has no parameter {leaf!r} to shard")
                pname = f"{mname}.{leaf}" if mname else leaf
                prev = out.get(pname, {})
                for ax, p in placements.items():
                    if ax in prev and prev[ax] != p:
                        raise ValueError(f"conflicting annotations for {pname!r} on axis {ax!r}: {prev[ax]} and {p}")
                out[pname] = {**prev, **placements}
    return out


def resolve_stages(model: nn.Module, ann: Annotations) -> dict[str, int]:
    names = {id(m): n for n, m in model.named_modules()}
    out = {}
    for mod, k in ann.stages:
        if isinstance(mod, nn.Module):
            if id(mod) not in names:
                raise ValueError(f"pipeline_stage() was given a module object ({type(mod).__name__}) that is not part "
                                 f"of the model being planned. {LEFTOVER}")
            out[names[id(mod)]] = k
        else:
            out[mod] = k
    return out
