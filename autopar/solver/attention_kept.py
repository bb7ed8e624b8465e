"""Recomputation around the attention core, in the search (``recompute="except_attention"``).

``kept_plans`` (AUTO/SEMI_AUTO, recomputation left to the search) runs after ``partial_recompute``: when
the fastest plan recomputes whole layers ("full" on every layer, or on ``r`` of them), it re-plans that
plan's candidate (``partial_recompute.Probe``: the same mesh, ZeRO stage, accumulation and, for a
pipeline under AUTO, parameter layout) with those layers recomputed around their attention core. Per
layer, with ``t`` its forward seconds, ``a`` its attention core's and ``m`` the bytes::

    "full":              time + t,      keeps the layer's input
    "except_attention":  time + t - a,  keeps the input and what the core saves (q, k, v, output,
                                        softmax statistics; the gather form's gathered K/V)

so "except_attention" is faster and holds more. The probe keeps ``j`` of the fully recomputed layers
"full" (spread evenly, ``recompute_layers.spread``) and turns the others to "except_attention". ``j = 0``
(all turned) is tried first: at long sequences, where the core is most of the forward, it usually fits.
Otherwise the smallest ``j`` that fits without the cap shaping the layout (``Plan.memory_bound``) is found
by bisection, as ``partial_recompute`` does (memory falls and time grows with ``j``; ``j`` = all is the
plan itself); with a pipeline ``j`` moves in steps of ``pp`` (each stage its share). Every probe that
fits joins the plans; the usual ranking picks.
"""
from __future__ import annotations

import math

from autopar.graph.recompute_layers import spread
from autopar.graph.recompute_regions import choices_for, find_regions, layer_names
from autopar.plan.plan import Plan
from autopar.solver.partial_recompute import Probe
from autopar.solver.request import SolveRequest

KEPT = "except_attention"


def _full_layers(recompute, names: list[str]) -> list[str]:
    if isinstance(recompute, dict):
        return [n for n in names if recompute.get(n, "none") == "full"]
    return list(names) if recompute == "full" else []


def _mapping(recompute, names: list[str], full: list[str], j: int) -> dict[str, str]:
    """``recompute`` with ``j`` of the ``full`` layers kept "full" and the others "except_attention"."""
    stay = spread(full, j)
    base = recompute if isinstance(recompute, dict) else {n: recompute for n in names}
    return {n: (stay.get(n, KEPT) if n in full else base.get(n, "none")) for n in names}


def kept_plans(req: SolveRequest, best: Plan, traces: dict, candidates) -> list[Plan]:
    """Plans of ``best``'s candidate with its fully recomputed layers recomputed around their attention
    core (module docstring); ``candidates``: ``search._candidates``; ``traces``: as ``partial_plans``."""
    if best.candidate == "DDP layout":
        return []
    rec = best.memory_options.recompute
    names = layer_names(req.traced.gm)
    full = _full_layers(rec, names)
    if not full or not find_regions(req.traced.gm, choices_for(req.traced.gm, {n: "selective" for n in full})):
        return []           # no attention core in those layers: "except_attention" is "full" there
    probe = Probe(req, best, traces, candidates)
    label = lambda j: f"recompute {KEPT} on {len(full) - j} of {len(names)} layers, full on {j}"   # noqa: E731
    out = probe.plans([_mapping(rec, names, full, 0)], label(0))
    if any(not p.memory_bound for p in out):
        return out
    top = -(-len(full) // probe.step)
    lo, hi = 0, top
    for _ in range(math.ceil(math.log2(max(top, 1)))):
        if hi - lo <= 1 or probe.out_of_time():
            break
        mid = (lo + hi) // 2
        j = min(len(full), mid * probe.step)
        got = probe.plans([_mapping(rec, names, full, j)], label(j))
        out += got
        if any(not p.memory_bound for p in got):
            hi = mid
        else:
            lo = mid
    return out


__all__ = ["kept_plans"]
