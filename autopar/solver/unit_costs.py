"""Per-unit costs of a pipeline's layers under one intra-op plan (``pipeline_search``, step 2):
time, state, saved activations, the bytes crossing each cut, and what each unit's parameters add
once per step (gradient sync, optimizer step, the data-parallel gradients' second copy).

    time_u   = sum_{v in u} node_time(v) - param_sync(v) + resharding collectives of v
               (not the node's own local implementation's: node_time holds them)
    again_u  = what recomputation adds: the forward again of recomputed nodes (their forward split
               as ``split_cost`` splits it) and the collectives listed with phase "recompute"
    fwd_u    = (time_u - again_u) * (sum base fwd / sum base fwd+bwd),   bwd_u = time_u - fwd_u
               (the recomputation runs in backward, ``passes/recompute.py``)
    param_u  = sum_{params p used in u} numel(p) * state bytes / shard(p)   (ZeRO: its stage's parts / d(p))
    act_u    = sum_{t saved by v in u} bytes(t) / shard(output of the node making t)   (internal: v's)
               + copies of recomputed regions' inputs v takes in another placement (scale with rows)
    kept_u   = parameters v in u takes in another placement than the stored one and saves for
               backward (the gathered copy): per microbatch in flight, whatever its rows
    out_u    = sum_{values crossing the cut after u} local bytes
    after_u  = with m > 1 microbatches, the data-parallel parameters' gradient bytes once more (not under ZeRO)

``UnitCosts.at`` rescales them to another microbatch size (kernel launches do not shrink).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from autopar.cost_models.compute import local_node_cost
from autopar.cost_models.node_cost_memo import cached_node_cost, node_cost_table
from autopar.cost_models.param_step import optimizer_step_time, working_copy_time
from autopar.graph.grads import grad_nodes
from autopar.cost_models.memory import dropout_mask_bytes_for, saves_input, training_state_parts
from autopar.cost_models.recompute import saved_storages
from autopar.solver.cp_costs import cp_saved_bytes
from autopar.cost_models.zero import sharded_state, zero_axes
from autopar.graph.cut_points import crossing_values
from autopar.plan.plan import Plan
from autopar.plan.specs import PlanSpecs
from autopar.sharding.candidates import producer
from autopar.cost_models.moe import is_moe
from autopar.sharding.placements import Replicate, local_shape, shard_factor
from autopar.sharding.strategy import tensor_inputs
from autopar.solver.inter_op import LayerProfile
from autopar.solver.problem import region_input_uses
from autopar.solver.recompute_collectives import RECOMPUTE_PHASE, region_of
from autopar.solver.strategy_prices import Costing, sync_element_bytes, tensor_bytes


@dataclass
class UnitCosts:
    """Per-unit inputs of the stage partition at one microbatch size."""

    profiles: list[LayerProfile]
    launch: list[float]       # kernel-launch seconds inside each unit's fwd+bwd (do not scale)
    sync: list[float]         # per-step gradient sync seconds of each unit's parameters
    batch: int                # the microbatch size profiled
    optimizer: list[float] = field(default_factory=list)   # optimizer-step seconds of each unit's parameters
    accumulated: list[float] = field(default_factory=list)  # bytes of each unit's second data-parallel gradient copy
    kept: list[float] = field(default_factory=list)  # bytes of each unit's gathered parameter copies, per microbatch

    def at(self, batch: int, microbatches: int = 1) -> list[LayerProfile]:
        """The profiles at microbatch size ``batch``; with several ``microbatches`` each unit also holds
        its data-parallel gradients' second copy (``memory_terms.accumulated_grad_bytes``) once the
        schedule is done (``LayerProfile.after_bytes``: the pipeline syncs its gradients after it).
        A microbatch in flight holds its gathered parameter copies (``kept``) at any size."""
        f = batch / self.batch
        extra = self.accumulated if microbatches > 1 and self.accumulated else [0.0] * len(self.profiles)
        kept = self.kept or [0.0] * len(self.profiles)
        out = []
        for p, launch, copy, k in zip(self.profiles, self.launch, extra, kept):
            total = p.fwd + p.bwd
            share = p.fwd / total if total else 0.5
            work = max(total - launch, 0.0) * f + min(launch, total)
            out.append(replace(p, fwd=work * share, bwd=work * (1 - share), activation_bytes=p.activation_bytes * f + k,
                               out_bytes=p.out_bytes * f, after_bytes=copy))
        return out



def _state_bytes(val, spec, shape, opts, zero: int) -> float:
    """A parameter's training state on one rank of its stage: its piece under ``spec``, with ZeRO's
    stages sharding their parts over the axes it is replicated on (``cost_models.zero.sharded_state``)."""
    w, g, o = training_state_parts(val.numel() / shard_factor(spec, shape), val.dtype, opts.optimizer, opts.precision)
    return sharded_state(w, g, o, zero_axes(spec, shape)[1], zero) if zero else w + g + o


def _moved_param_sync(node, d, traced, costing: Costing, mesh_shape) -> float:
    """Gradient all-reduce of parameter inputs that the node's cost includes but runs once per step."""
    outs = d.output if isinstance(d.output, list) else [d.output]
    split = {a for o in outs for a, p in enumerate(o) if not isinstance(p, Replicate)}
    t = 0.0
    for i, inp in enumerate(tensor_inputs(node)):
        if inp.op != "placeholder" or inp.name not in traced.params or i >= len(d.inputs):
            continue
        spec = d.inputs[i]
        for a in split:
            if isinstance(spec[a], Replicate):
                t += costing.grad_sync(costing.grad_bytes(inp) / shard_factor(spec, mesh_shape), a)
    return t


def _forward_again(node, d, base, shape, device) -> float:
    """One rank's forward of ``node`` under its placement, as ``strategy_prices.split_cost`` costs it: a
    matmul on its local shapes (its efficiency follows its local smallest dimension), other work divided
    by the split with the launches whole."""
    ways = max([shard_factor(sp, shape) for sp in d.inputs + _outputs(d) if sp] + [1])
    if ways > 1 and not is_moe(node):
        ins = tensor_inputs(node)
        shapes = {a: local_shape(a.meta["val"].shape, sp, shape) for a, sp in zip(ins, d.inputs) if sp is not None}
        local = local_node_cost(node, shapes, device)
        if local is not None and math.isclose(local.flops_fwd * ways, base.flops_fwd, rel_tol=0.02):
            return local.time_fwd
    return (base.time_fwd - base.launch_fwd) / ways + base.launch_fwd


def _outputs(d) -> list:
    """A node decision's output specs (one or several)."""
    return list(d.output) if isinstance(d.output, list) else [d.output]


def _split(specs: PlanSpecs, node, shape) -> int:
    """How many ways the plan splits ``node``'s (first) output (at least 1)."""
    d = specs.plan.nodes.get(node.name)
    return max(1, shard_factor(specs.spec(node, 0 if d is not None and isinstance(d.output, list) else None), shape))


class KeptCopies:
    """What a unit's ops keep for backward in another placement than the value is stored in, as the
    whole model's plan counts it (``problem.resharded_param_bytes``, ``resharded_region_inputs``):
    one copy per (value, placement) in each unit that makes it (stages are separate programs; a
    value two units of one stage take alike is charged twice). ``params``: gathered
    parameter copies (one per microbatch in flight, whatever its rows); ``regions``: recomputed
    regions' inputs (they scale with the rows)."""

    def __init__(self, traced, plan: Plan, mask_bytes):
        self.plan, self.mask = plan, mask_bytes
        self.shape = plan.mesh.shape
        self.params = set(traced.params)
        self.stored = {d.placeholder: d.spec for d in plan.params.values()}
        self.need = grad_nodes(traced.gm.graph)
        costing = Costing(self.shape, None, recompute=plan.memory_options.recompute or "none")
        recomputed = plan.memory_options.recompute not in (None, "none")
        self.region_uses = region_input_uses(traced.gm, costing) if recomputed else set()
        self.seen: set = set()

    def of(self, node, unit: int) -> tuple[float, float]:
        """(parameter copies, region input copies) bytes ``node`` makes first in ``unit``."""
        d = self.plan.nodes.get(node.name)
        if d is None or node.op != "call_function":
            return 0.0, 0.0
        params = regions = 0.0
        for i, a in enumerate(tensor_inputs(node)):
            if i >= len(d.inputs) or d.inputs[i] is None:
                continue
            spec = d.inputs[i]
            if a.name in self.params and a.name in self.stored:
                key = (unit, a.name, spec)
                if node in self.need and spec != self.stored[a.name] and key not in self.seen \
                        and saves_input(node, a, self.mask):
                    self.seen.add(key)
                    params += tensor_bytes(a) / shard_factor(spec, self.shape)
            elif (node.name, i) in self.region_uses:
                src, idx = producer(a)
                have = self.plan.nodes.get(src.name)
                if have is None:
                    continue
                out = have.output if idx is None else have.output[idx]
                key = (unit, src.name, idx, spec)
                if spec != out and key not in self.seen:
                    self.seen.add(key)
                    regions += tensor_bytes(src, idx) / shard_factor(spec, self.shape)
        return params, regions


def _listed_times(plan: Plan, params) -> tuple[dict, dict, dict, dict]:
    """Per node, seconds of the plan's listed collectives: (those a unit adds to the node time:
    its inputs' redistributions, recomputed ones included; those a recomputation runs again; those
    the node time holds already: its own local implementation's and its activation-gradient
    all-reduces; per parameter, its gradient sync)."""
    coll_time: dict[str, float] = {}
    again_time: dict[str, float] = {}
    held_time: dict[str, float] = {}
    sync_time: dict[str, float] = {}
    for c in plan.collective_list:
        if c.node in params:
            sync_time[c.node] = sync_time.get(c.node, 0.0) + c.time
            continue
        if c.phase == RECOMPUTE_PHASE:
            again_time[c.node] = again_time.get(c.node, 0.0) + c.time
        if c.in_node or c.kind == "all_reduce" and c.phase == "bwd":
            held_time[c.node] = held_time.get(c.node, 0.0) + c.time
        elif c.phase in ("fwd", "bwd", RECOMPUTE_PHASE):
            coll_time[c.node] = coll_time.get(c.node, 0.0) + c.time
    return coll_time, again_time, held_time, sync_time


def launch_seconds(traced, device) -> float:
    """Kernel-launch seconds of one forward and backward of every op of ``traced`` on ``device``: at least
    the launches of any layout's units (``UnitCosts.launch``, each unit's capped by its time), known before
    a layout is solved."""
    costs = node_cost_table(traced.gm.graph, device)
    ops = [cached_node_cost(costs, n, device) for n in traced.gm.graph.nodes if n.op == "call_function"]
    return sum(c.launch_fwd + c.launch_bwd for c in ops)


def unit_profiles(traced, plan: Plan, units, unit_of, device, opts) -> UnitCosts:
    """Per-unit time, memory and crossing bytes under the intra-op ``plan`` (module docstring, step 2)."""
    gm, shape = traced.gm, plan.mesh.shape
    costing = Costing(shape, device, opts.optimizer, opts.precision, zero=plan.memory_options.zero,
                      grad_element_bytes=sync_element_bytes(opts.precision, opts.grad_compression),
                      moe_imbalance=opts.moe_imbalance)     # zero: the sync the node times hold (_moved_param_sync)
    specs = PlanSpecs(plan, len(shape))
    by_name = {n.name: n for n in gm.graph.nodes}
    saved: dict[str, list[tuple[object, int, bool, str]]] = {}
    for node_name, key, nbytes, internal, tensor in saved_storages(gm, plan.memory_options.recompute,
                                                                   dropout_mask_bytes_for(device.name)):
        saved.setdefault(node_name, []).append((key, nbytes, internal, tensor))
    coll_time, again_time, held_time, sync_time = _listed_times(plan, traced.params)
    recomputed = region_of(gm, plan.memory_options.recompute)
    param_spec = {d.placeholder: d.spec for d in plan.params.values()}
    zero = plan.memory_options.zero
    cuts = crossing_values(gm, unit_of, len(units))
    seen_saved: set = set()     # storage keys: views of one storage (q, k, v of one projection) count once
    copied = KeptCopies(traced, plan, dropout_mask_bytes_for(device.name))
    costs = node_cost_table(gm.graph, device)
    profiles, launches, syncs, steps, copies, kept = [], [], [], [], [], []
    for unit in units:
        time = fwd_base = total_base = launch = act = held = again = 0.0
        params: set[str] = set()
        for name in unit.nodes:
            node, d = by_name[name], plan.nodes.get(name)
            if d is None:
                continue
            base = cached_node_cost(costs, node, device)
            fwd_base += base.time_fwd
            total_base += base.time_total
            launch += base.launch_fwd + base.launch_bwd
            own = d.time - _moved_param_sync(node, d, traced, costing, shape)
            time += own + coll_time.get(name, 0.0)
            again += again_time.get(name, 0.0)
            if name in recomputed:      # its forward again, split as ``split_cost`` splits it (launches whole)
                again += min(_forward_again(node, d, base, shape, device), max(own - held_time.get(name, 0.0), 0.0))
            out_shard = _split(specs, node, shape)
            in_shard = shard_factor(d.inputs[0], shape) if d.inputs and d.inputs[0] else 1
            for key, nbytes, internal, tensor in saved.get(name, []):
                if key not in seen_saved:
                    seen_saved.add(key)
                    # a tensor the op makes itself (log-probs, statistics) splits like its input; a
                    # graph tensor as the node that makes it (a row-parallel linear saves its
                    # tp-split input, not its partial output)
                    act += nbytes / (max(out_shard, in_shard) if internal else _split(specs, by_name[tensor], shape))
            params |= {i.name for i in tensor_inputs(node) if i.op == "placeholder" and i.name in traced.params}
            act += cp_saved_bytes(node, d, costing, recomputed=name in recomputed)   # the gather form's K/V
            param_copies, region_copies = copied.of(node, unit.index)
            held += param_copies
            act += region_copies
        time += sum(working_copy_time(by_name[p].meta["val"].numel() / shard_factor(param_spec[p], shape), device,
                                      opts.precision) for p in params if p in param_spec)
        share = fwd_base / total_base if total_base else 1 / 3
        pbytes = sum(_state_bytes(by_name[p].meta["val"], param_spec[p], shape, opts, zero)
                     for p in params if p in param_spec)
        nxt = unit.index + 1
        out = sum(tensor_bytes(v) / shard_factor(specs.spec(v), shape) for v in cuts[nxt]) if nxt < len(units) else 0.0
        fwd = (time - again) * share
        profiles.append(LayerProfile(unit.name, fwd, time - fwd, pbytes, act, out))
        launches.append(min(launch, time))
        syncs.append(sum(sync_time.get(p, 0.0) for p in params))
        numel = sum(by_name[p].meta["val"].numel() / shard_factor(param_spec[p], shape)
                    / (zero_axes(param_spec[p], shape)[1] if zero else 1) for p in params if p in param_spec)
        steps.append(optimizer_step_time(numel, device, len(params), opts.optimizer))
        # ZeRO sums the gradients in buckets (the sub-plan's transient), no second whole copy
        copies.append(0.0 if zero else
                      sum(training_state_parts(by_name[p].meta["val"].numel() / shard_factor(param_spec[p], shape),
                                               by_name[p].meta["val"].dtype, opts.optimizer, opts.precision)[1]
                          for p in params if p in param_spec and zero_axes(param_spec[p], shape)[1] > 1))
        kept.append(held)
    return UnitCosts(profiles, launches, syncs, traced.batch_size, steps, copies, kept)
