"""A floor for a mesh under ZeRO-1 from its floor under ZeRO-0, without solving it (``search._share_floors``).

For one assignment L of a flat mesh (the same candidates, the same edges), the two stages' step times
differ only in what ``strategy_prices`` charges a parameter and the consumers of its gradient:

    ZeRO-0:  step(n) + cast                  and each consumer's share of the bucketed all-reduce AR
    ZeRO-1:  step(n / d) + cast + AG >= cast  and its share of the bucketed reduce-scatter RS

(``_param_state_cost``, ``Costing.grad_sync``; ``n`` the parameter's local elements, ``d`` its ZeRO
ranks, AG its weights' all-gather; the once-per-step split of accumulation is the same in both). The
comm model's ring halves: RS(b) = AR(b) / 2 on one link, and where the all-reduce takes the cheaper
hierarchical form RS(b) >= AR(b) / 2 still (``comm.axis_collective_time``). Bucketed, a tensor pays
``full - lat (1 - r)`` with ``r = min(1, b / bucket)``, so RS >= AR / 2 - lat_RS (1 - r): a tensor of a
bucket or more loses nothing, a smaller one at most its share of one reduce-scatter latency. So

    T1(L) >= T0(L) - AR(L) / 2 - sum_p step(n_p) - sum_p sum_axes lat_RS(axis) (1 - r_p)

and AR(L), the parameters' gradient all-reduces, is part of T0(L) (every other term of T0 is >= 0 but
the fused gathers' savings, each at most its own consumer's activation all-reduce, also in T0). With
``S`` the two sums at their largest (every parameter whole: ``zero1_slack``), every ZeRO-1 assignment
takes at least ``T0 / 2 - S``, and a proven ZeRO-0 floor F0 (any budget) gives the ZeRO-1 floor
``F0 / 2 - S``. It only grows with accumulation and recomputation as F0 does.
"""
from __future__ import annotations

import math

from autopar.cost_models.comm import GRAD_BUCKET_BYTES, axis_collective_time
from autopar.cost_models.devices import mesh_device
from autopar.cost_models.param_step import optimizer_step_time
from autopar.core.mesh import Mesh
from autopar.solver.strategy_prices import sync_element_bytes


def zero1_slack(traced, shape: tuple, mesh: Mesh, opts) -> float:
    """``S`` of the module docstring for the flat mesh ``shape`` cut from ``mesh`` (its device, nodes):
    each parameter's whole optimizer step, and each one under a bucket its share of one reduce-scatter
    latency on every axis."""
    per_node = min(math.prod(shape), mesh.gpus_per_node or math.prod(shape))
    device = mesh_device(mesh).shared_by(per_node).with_compile(opts.compiled)    # as ``solve_on_mesh`` costs it
    elem = sync_element_bytes(opts.precision, opts.grad_compression)
    lat = [axis_collective_time("reduce_scatter", 1.0, device, size, math.prod(shape[i + 1:]))
           for i, size in enumerate(shape)]
    total = 0.0
    by_name = {n.name: n for n in traced.gm.graph.nodes}
    for name in traced.params:
        node = by_name.get(name)
        v = node.meta.get("val") if node is not None else None
        if v is None:
            continue
        total += optimizer_step_time(v.numel(), device, 1, opts.optimizer)
        grad = v.numel() * (elem or v.element_size())
        total += sum(lat) * (1.0 - min(1.0, grad / GRAD_BUCKET_BYTES))
    return total


def zero1_floor(floor0: float, slack: float) -> float:
    """The ZeRO-1 floor a ZeRO-0 floor ``floor0`` proves (module docstring); -inf where it proves nothing."""
    out = floor0 / 2 - slack
    return out if out > 0 else -math.inf


__all__ = ["zero1_floor", "zero1_slack"]
