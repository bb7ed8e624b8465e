"""Memory a step holds beside the intra-op ILP's row, evaluated on an assignment after the solve
(``mesh_solve._solve_within``): ZeRO's per-layer buffers and the backward transients (maxima over
ops and regions, not sums), and ``op_transients``, lower bounds of the transients the solver keeps
room for. The row itself (node and edge memory) is priced in ``strategy_prices.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch.fx as fx

from autopar.graph.grads import grad_nodes
from autopar.cost_models.memory import storage_key, training_state_parts
from autopar.cost_models.zero import (gather_unit, shard_elements, zero1_bucket_bytes, zero3_gathered_bytes, zero_axes,
                                      zero_buckets)
from autopar.graph.recompute_regions import choices_for, find_regions
from autopar.sharding.candidates import Candidates
from autopar.sharding.placements import shard_factor
from autopar.sharding.strategy import Strategy, tensor_inputs
from autopar.solver.cp_costs import cp_saved_bytes, cp_transient_bytes
from autopar.solver.problem import BuiltProblem, resharded_param_bytes, saved_bytes_once
from autopar.solver.strategy_prices import Costing, local_saved, saved_pair, strategy_outputs, tensor_bytes


def zero_layer_buffers(gm: fx.GraphModule, cands: Candidates, built: BuiltProblem, choice: list[int], c: Costing,
                   param_names: dict[str, str]) -> float:
    """ZeRO's per-layer buffers at the peak, for the largest unit (``zero.gather_unit``) of the
    parameters ZeRO shards. ZeRO-3: the unit's local weights in full, twice (the next unit's
    gather is prefetched), ``zero3_gathered_bytes``. ZeRO-2: the unit's gradient bucket while it
    is reduce-scattered in backward: its working gradients in full and the bucket they are copied
    into (``runtime/zero.py``), twice the unit's local gradients. ``param_names``: placeholder ->
    parameter name."""
    if c.zero not in (2, 3):
        return 0.0
    by_name = {n.name: n for n in gm.graph.nodes}
    units: dict[str, float] = {}
    for ph, name in param_names.items():
        if ph not in built.index:
            continue
        v = by_name[ph].meta["val"]
        st = cands.strategies[ph][choice[built.index[ph]]]
        if zero_axes(st.output, c.mesh_shape)[1] == 1:
            continue                # nothing to shard it over: its state is whole
        local = v.numel() / shard_factor(st.output, c.mesh_shape)
        weight, grad = training_state_parts(local, v.dtype, c.optimizer, c.precision)[:2]
        units[gather_unit(name)] = units.get(gather_unit(name), 0.0) + (weight if c.zero == 3 else grad)
    return zero3_gathered_bytes(max(units.values(), default=0.0), weight_bytes=1)


def transient_bytes(gm: fx.GraphModule, cands: Candidates, built: BuiltProblem, choice: list[int],
                    c: Costing, params: dict[str, str]) -> float:
    """Workspace above the saved activations at the step's peak (a max, not a sum: added to the
    plan's predicted memory after the solve, not in the ILP). ``params``: placeholder -> parameter name.

    Per op that needs a gradient, ``g(n)``: the local gradients live while its backward runs --
    its output's and its non-parameter inputs' (each storage once: a view's gradient is a view)
    plus one per tensor the op makes and saves itself (a cross-entropy's log-probabilities have a
    gradient of their own: the loss's backward holds two logits-sized gradients next to the saved
    log-probabilities, which for a GPT is the largest op of the step). Under recomputation a
    region's backward first runs its forward again, so everything the region would have saved,
    ``remat(R)`` (local bytes under the chosen placements), is live with the gradients of its ops::

        transient = max( max_{n in no region} g(n),  max_R [ remat(R) + max_{n in R} g(n) ] )

    Parameter gradients count in ``g(n)`` where they exist beside the state's own gradient term
    (``_param_grad_terms``): with ZeRO 0/1 and several microbatches per step, a parameter's fresh
    gradient (local bytes as op ``n`` takes it) is a buffer of its own until autograd adds it into
    the ``.grad`` the earlier microbatches left; and a weight with several users (a tied
    embedding and lm-head) has its first computed gradient waiting in autograd's input buffer
    from its last user's backward to its first user's (the whole backward of a GPT), under
    accumulation and under ZeRO-2/3 (whose state holds 1/d of the gradients; ZeRO-3 also keeps the
    weight gathered again for the last user until then) -- with one
    microbatch and ZeRO 0/1 that buffer becomes ``.grad``, but each later user's contribution is
    still a buffer of its own.

    ZeRO-1 reduce-scatters after backward, when the activations (and gathered parameter copies) are
    gone, from a copy of its largest bucket (``zero1_after_backward``): the transient is at least
    that copy less what backward freed. ZeRO-3 reduce-scatters each layer's gradients in backward
    when its gathered weights are done with (``zero3_reduce_scatter``): the transient is at least that
    less ZeRO-3's gathered layers, which the total holds anyway. Without ZeRO, several microbatches keep their local sums
    in gradients of their own beside the synced gradients' buffer (DDP's bucket, allocated once
    and held; a pipeline's flat buffer at the sum), so the data-parallel gradients count twice.
    """
    by_name = {n.name: n for n in gm.graph.nodes}
    mask = 1 if getattr(c.device, "name", "") != "cpu" else None
    saved = saved_bytes_once(gm, mask)
    need = grad_nodes(gm.graph)
    facts = op_gradient_facts(gm, params, c)
    fresh, waiting = _param_grad_terms(gm, cands, built, choice, c, params, need)
    grads: dict[str, float] = {}
    for pos, node in enumerate(gm.graph.nodes):
        name = node.name
        if name not in built.index or name not in facts:
            continue
        st = cands.strategies[name][choice[built.index[name]]]
        live, own = _op_gradients(facts[name], st, c)
        for key, nbytes in fresh.get(name, {}).items():
            live.setdefault(key, nbytes)
        for lo, hi, key, nbytes in waiting:
            if lo <= pos < hi:
                live.setdefault(key, nbytes)
        grads[name] = sum(live.values()) + own
    regions = find_regions(gm, choices_for(gm.graph, c.recompute)) if c.recompute not in (None, "none") else []
    inside = {n for r in regions for n in r.nodes}
    peak = max((g for n, g in grads.items() if n not in inside), default=0.0)
    for r in regions:
        # the region's forward again holds what its nodes save (the gather form's gathered K/V too)
        remat = sum(local_saved(by_name[n], st, saved, c) + cp_saved_bytes(by_name[n], st, c)
                    for n in r.nodes if n in built.index
                    for st in (cands.strategies[n][choice[built.index[n]]],))
        peak = max(peak, remat + max((grads.get(n, 0.0) for n in r.nodes), default=0.0))
    if c.zero == 1:
        freed = sum(float(built.problem.nodes[i].memory[choice[i]]) for i, n in enumerate(built.names) if n not in params)
        freed += resharded_param_bytes(gm, cands, built, choice, c, set(params))
        peak = max(peak, zero1_after_backward(gm, cands, built, choice, c, params) - freed)
    if c.zero == 3:
        rs = zero3_reduce_scatter(gm, cands, built, choice, c, params) + sum(w[3] for w in waiting)
        peak = max(peak, rs - zero_layer_buffers(gm, cands, built, choice, c, params))
    return peak + accumulated_grad_bytes(gm, cands, built, choice, c, params)


def accumulated_grad_bytes(gm: fx.GraphModule, cands: Candidates, built: BuiltProblem, choice: list[int], c: Costing,
                           params: dict[str, str]) -> float:
    """The second copy of every data-parallel gradient that several microbatches keep without ZeRO
    (``transient_bytes``' last term: the local sums beside the synced buffer), 0 otherwise. A sum
    over parameters, so a pipeline stage holds only its own parameters' share (``unit_profiles``)."""
    if c.zero != 0 or c.microbatches <= 1:
        return 0.0
    return sum(g for _, _, g, _, _ in _replicated_grads(gm, cands, built, choice, c, params))


@dataclass(frozen=True)
class OpGradients:
    """What ``node``'s backward holds, before placements divide it: its output's gradient (storage
    key, full bytes), its non-parameter inputs' that need one ((input index, key, bytes)), and the
    bytes it saves of its own."""

    out_key: object
    out_bytes: float
    inputs: tuple
    own: float


def op_gradient_facts(gm: fx.GraphModule, params, c: Costing) -> dict[str, OpGradients]:
    """``OpGradients`` of every op that needs a gradient, once per graph (kept in ``gm.meta``: the
    search solves one graph under many meshes and memory options)."""
    mask = 1 if getattr(c.device, "name", "") != "cpu" else None
    cache = gm.meta.setdefault("op_gradient_facts", {})
    key = (id(gm.graph), len(gm.graph.nodes), mask, frozenset(params))
    if key not in cache:
        saved = saved_bytes_once(gm, mask)
        need = grad_nodes(gm.graph)
        facts = {}
        for node in gm.graph.nodes:
            if node.op != "call_function" or node not in need:
                continue
            ins = tuple((i, storage_key(a), tensor_bytes(a)) for i, a in enumerate(tensor_inputs(node))
                        if a in need and a.name not in params)
            facts[node.name] = OpGradients(
                storage_key(node), tensor_bytes(node, 0 if isinstance(node.meta.get("val"), (tuple, list)) else None),
                ins, saved_pair(saved, node.name)[1])
        cache[key] = facts
    return cache[key]


def _gradient_shape(f: OpGradients) -> tuple:
    """What ``_op_gradients`` reads of ``f`` but the storages' identities: the bytes, and which
    tensors share a storage (each key by its first position)."""
    first = {f.out_key: 0}
    return f.out_bytes, f.own, tuple((i, first.setdefault(key, len(first)), nbytes) for i, key, nbytes in f.inputs)


def _op_gradients(f: OpGradients, st: Strategy, c: Costing) -> tuple[dict, float]:
    """The local gradients live while the op's backward runs under strategy ``st`` (storage key
    -> bytes: its output's and its non-parameter inputs') and the bytes it saves of its own, its
    share under ``st`` (``transient_bytes``'s g(n) without the parameter-gradient terms)."""
    out_shard = max(1, shard_factor(strategy_outputs(st)[0], c.mesh_shape))
    in_shard = shard_factor(st.inputs[0], c.mesh_shape) if st.inputs else 1
    live = {f.out_key: f.out_bytes / out_shard}
    for i, key, nbytes in f.inputs:
        if i < len(st.inputs):
            live.setdefault(key, nbytes / max(1, shard_factor(st.inputs[i], c.mesh_shape)))
    return live, f.own / max(out_shard, in_shard) + cp_transient_bytes(st, c, [(i, b) for i, _, b in f.inputs])


def op_transients(gm: fx.GraphModule, cands: Candidates, built: BuiltProblem, c: Costing,
                  params: dict[str, str]) -> tuple[list[np.ndarray | None], list[np.ndarray | None]]:
    """Two lower bounds on ``transient_bytes`` as per-node, per-strategy bytes (None: none), for
    the intra-op solver to keep beside its memory row (``IntraOpProblem.transient``), so that the
    first solve already leaves the workspace room:

    * max terms: the backward workspace an op's own gradients need (g(n) without the
      parameter-gradient, recomputation and ZeRO terms, which only add); the peak holds the largest;
      they depend on the graph and the mesh only, and are kept per (candidates, mesh) in ``gm.meta``;
    * sum terms: without ZeRO, under accumulation, each data-parallel parameter's gradient a second
      time (``_replicated_grads``), which ``transient_bytes`` adds to any op's peak."""
    facts = op_gradient_facts(gm, params, c)
    cache = gm.meta.setdefault("op_transients", {})
    key = (id(cands), tuple(c.mesh_shape), id(facts))
    if key not in cache:
        kinds = c._memo.get(("kinds", id(cands))) or {}     # ``problem._node_kinds``: equal strategies
        alike: dict = {}        # repeated layers: one array per (kind, gradient sizes and aliasing)
        terms = {}
        for name, f in facts.items():
            if name not in cands.strategies:
                continue
            sig = (kinds[name], _gradient_shape(f)) if name in kinds else name
            if sig not in alike:
                alike[sig] = np.array([sum(live.values()) + own for live, own in
                                       (_op_gradients(f, st, c) for st in cands.strategies[name])])
            terms[name] = alike[sig]
        cache[key] = terms
    terms = cache[key]
    out: list[np.ndarray | None] = [terms.get(name) for name in built.names]
    added: list[np.ndarray | None] = [None] * len(built.names)
    if c.zero == 0 and c.microbatches > 1:
        by_name = {n.name: n for n in gm.graph.nodes}
        for ph in params:
            if ph not in built.index:
                continue
            v = by_name[ph].meta["val"]
            added[built.index[ph]] = np.array([(g or (0, 0.0))[1] for g in
                                               (_replicated_grad(v, st, c) for st in cands.strategies[ph])])
    return out, added


def zero3_reduce_scatter(gm: fx.GraphModule, cands: Candidates, built: BuiltProblem, choice: list[int], c: Costing,
                         params: dict[str, str]) -> float:
    """Bytes beside the state and the saved activations while ZeRO-3 reduce-scatters its largest
    layer in backward (``runtime/zero3.py``): the layer's gradients in full, the ``(d, C)`` input they
    are copied into (twice where the collective copies it: gloo) and the ``C`` output."""
    units: dict[tuple, list[float]] = {}
    for name, local, grad, axes, d in _replicated_grads(gm, cands, built, choice, c, params):
        u = units.setdefault((gather_unit(name), axes, d), [0.0, 0.0])
        u[0] += grad
        u[1] += shard_elements(local, d) * grad / max(local, 1)
    copies = 2 if getattr(c.device, "name", "") == "cpu" else 1
    return max((g + chunk * (d * copies + 1) for (_, _, d), (g, chunk) in units.items()), default=0.0)


def zero1_after_backward(gm: fx.GraphModule, cands: Candidates, built: BuiltProblem, choice: list[int], c: Costing,
                         params: dict[str, str]) -> float:
    """Bytes beside the training state while ZeRO-1 reduce-scatters its largest bucket after backward
    (``cost_models.zero.zero1_bucket_bytes``, the runtime's buckets per set of axes; gloo, on CPU,
    copies the collective's input)."""
    sets: dict[tuple, list[tuple[str, int, int]]] = {}
    for name, local, grad, axes, d in _replicated_grads(gm, cands, built, choice, c, params):
        sets.setdefault((axes, d), []).append((name, local, int(round(grad / max(local, 1)))))
    copied = getattr(c.device, "name", "") == "cpu"
    return max((zero1_bucket_bytes(zero_buckets(ps, d), d, copied) for (_, d), ps in sets.items()), default=0.0)


def _replicated_grads(gm: fx.GraphModule, cands: Candidates, built: BuiltProblem, choice: list[int], c: Costing,
                      params: dict[str, str]) -> list[tuple[str, int, float, tuple, int]]:
    """(name, local elements, local gradient bytes, axes, d) of each parameter replicated over mesh
    axes of d > 1 ranks (``zero_axes``): those whose gradients a data-parallel sync sums."""
    by_name = {n.name: n for n in gm.graph.nodes}
    out = []
    for ph, name in params.items():
        if ph not in built.index:
            continue
        g = _replicated_grad(by_name[ph].meta["val"], cands.strategies[ph][choice[built.index[ph]]], c)
        if g is not None:
            out.append((name, *g))
    return out


def _replicated_grad(v, st: Strategy, c: Costing) -> tuple[int, float, tuple, int] | None:
    """(local elements, local gradient bytes, axes, d) of a parameter (value ``v``) stored under ``st``
    when it is replicated over mesh axes of d > 1 ranks, else None."""
    axes, d = zero_axes(st.output, c.mesh_shape)
    if d == 1:
        return None
    local = int(v.numel() // shard_factor(st.output, c.mesh_shape))
    return local, training_state_parts(local, v.dtype, c.optimizer, c.precision)[1], tuple(axes), d


def _param_grad_terms(gm: fx.GraphModule, cands: Candidates, built: BuiltProblem, choice: list[int], c: Costing,
                      params: set[str], need: frozenset) -> tuple[dict[str, dict], list[tuple[int, int, object, float]]]:
    """The parameter gradients ``transient_bytes`` adds (its docstring): ({user node: {key: bytes}}
    of fresh gradients that are buffers of their own, local bytes as the user takes the parameter;
    [(first use, last use, key, bytes)] of tied weights' waiting gradients, local bytes as stored,
    live while the backward runs through the nodes at graph positions ``first <= pos < last``)."""
    held = c.microbatches > 1 and c.zero < 2      # earlier microbatches' .grad beside each fresh gradient
    uses: dict[fx.Node, list[tuple[int, str, float, object]]] = {}
    for pos, node in enumerate(gm.graph.nodes):
        if node.op != "call_function" or node not in need or node.name not in built.index:
            continue
        st = cands.strategies[node.name][choice[built.index[node.name]]]
        for i, a in enumerate(tensor_inputs(node)):
            if a.name in params and a in need and i < len(st.inputs):
                nbytes = tensor_bytes(a) / max(1, shard_factor(st.inputs[i], c.mesh_shape))
                view = _same_storage(node, a)   # a view's gradient is its output's: counted
                uses.setdefault(a, []).append((pos, node.name, nbytes, storage_key(a) if view else ("fresh", pos, i)))
    fresh: dict[str, dict] = {}
    waiting = []
    for a, us in uses.items():
        tied = len({u[1] for u in us}) > 1
        for pos, name, nbytes, key in us:
            if held or (tied and pos != us[-1][0]):
                fresh.setdefault(name, {})[key] = nbytes
        if tied and (held or c.zero >= 2):
            stored = cands.strategies[a.name][choice[built.index[a.name]]].output if a.name in built.index else ()
            nbytes = tensor_bytes(a) / max(1, shard_factor(stored, c.mesh_shape)) if stored else us[-1][2]
            # ZeRO-3 also keeps the weight its last use gathered again in backward until the first
            # use's backward is done (``runtime/zero3.py``'s cache of a layer's gathered weights)
            waiting.append((us[0][0], us[-1][0], ("waiting", a.name), nbytes * (2 if c.zero == 3 else 1)))
    return fresh, waiting


def _same_storage(a: fx.Node, b: fx.Node) -> bool:
    """Whether two values share a storage (``storage_key`` is a weak storage reference or, for a value
    without a tensor storage such as an opaque function's output, a tuple: only like compare)."""
    ka, kb = storage_key(a), storage_key(b)
    return type(ka) is type(kb) and ka == kb
