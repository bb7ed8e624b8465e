"""Recomputation around the attention core, in the search (``recompute="except_attention"``).

``kept_plans`` (AUTO/SEMI_AUTO, recomputation left to the search) runs after ``partial_recompute``: when
the fastest plan recomputes whole layers ("full" on every layer, or on ``r`` of them), it re-plans that
plan's candidate (``partial_recompute.Probe``: the same mesh, accumulation and ZeRO stage, ZeRO-1 for a
pipeline at ZeRO-0) with those layers recomputed around their attention core. Per layer, with ``t`` its
forward seconds and ``a`` its attention core's::

    "full":              time + t,      keeps the layer's input
    "except_attention":  time + t - a,  keeps the input and what the core saves (q, k, v, output,
                                        softmax statistics; the gather form's gathered K/V)

so "except_attention" is faster and holds more. The probe keeps ``j`` of the fully recomputed layers
"full" (spread evenly, ``recompute_layers.spread``) and turns the others to "except_attention". ``j = 0``
(all turned) is tried first (under AUTO a pipeline's both with the "full" plan's parameter layout and with
one solved anew): at long sequences, where the core is most of the forward, it usually fits. Otherwise
the smallest ``j`` that fits without the cap shaping the layout (``Plan.memory_bound``) is found by
bisection, as ``partial_recompute`` does (memory falls and time grows with ``j``; ``j`` = all is the plan
itself; under AUTO a pipeline's probes keep that plan's parameter layout); with a pipeline ``j`` moves in
steps of ``pp`` (each stage its share). Every probe that fits joins the plans; the usual ranking picks.

Which plans are probed (``worth_probing``): the fastest plan of each candidate (mesh, or pipeline on its
named mesh) that recomputes a layer "full", fastest first, at most ``LIMIT``; one slower than the best plan
only while ``step x (1 - c / 3)`` is under the best plan's step, ``c`` its attention cores' share of its
ops' time (``core_share``), and with the all-turned probe only (the best plan's probe bisects). Keeping
the cores saves their forward again; under "full" a core's time is its forward twice and its backward,
so where the backward takes at least the forward the saving is at most ``c / 3`` of the ops' time, and
``step x (1 - c / 3)`` an optimistic estimate of the probe's step (the stage cut and the schedule scale
with the ops' time): a filter, not a proof. No plan is probed, the best included, whose estimate gains
less than ``MIN_GAIN`` of its step (short sequences, where the cores are a sliver of the work: the probes
would cost search time for nothing). Llama 3 405B at 131,072 tokens: 8 stages with "full" beat 16
stages with "full" by 1 %, and with "except_attention" each gains 12 %.
"""
from __future__ import annotations

from autopar.graph.recompute_layers import spread
from autopar.graph.recompute_regions import choices_for, find_regions, layer_names
from autopar.plan.plan import Plan
from autopar.solver.partial_recompute import Probe
from autopar.solver.request import SolveRequest

KEPT = "except_attention"
LIMIT = 3
MIN_GAIN = 0.005        # a plan whose estimate gains less than this share of its step is not probed


def attention_cores(gm) -> frozenset[str]:
    """The nodes of every attention core of ``gm``'s layers ("selective"'s regions)."""
    names = layer_names(gm)
    return frozenset(n for r in find_regions(gm, choices_for(gm, {n: "selective" for n in names})) for n in r.nodes)


def core_share(plan: Plan, cores: frozenset[str]) -> float:
    """The attention cores' share of ``plan``'s op seconds (``NodeDecision.time``)."""
    total = sum(d.time for d in plan.nodes.values())
    return sum(d.time for n, d in plan.nodes.items() if n in cores) / total if total > 0 else 0.0


def worth_probing(plans: list[Plan], rank_key, cores: frozenset[str]) -> list[Plan]:
    """The plans ``kept_plans`` starts from (module docstring), best first; the caller re-checks the
    estimate against the best plan after each probe."""
    if not cores:
        return []
    first: dict = {}
    for p in sorted(plans, key=rank_key):
        key = (p.mesh.shape, p.mesh.axis_names, p.pipeline is not None)
        if key not in first and _some_full(p.memory_options.recompute) and p.candidate != "DDP layout":
            first[key] = p
    return list(first.values())[:LIMIT]


def _some_full(recompute) -> bool:
    """Whether a recompute choice recomputes some layer "full"."""
    return recompute == "full" or isinstance(recompute, dict) and "full" in recompute.values()


def _full_layers(recompute, names: list[str]) -> list[str]:
    """The layers of ``names`` that ``recompute`` recomputes "full"."""
    if isinstance(recompute, dict):
        return [n for n in names if recompute.get(n, "none") == "full"]
    return list(names) if recompute == "full" else []


def _mapping(recompute, names: list[str], full: list[str], j: int) -> dict[str, str]:
    """``recompute`` with ``j`` of the ``full`` layers kept "full" and the others "except_attention"."""
    stay = spread(full, j)
    base = recompute if isinstance(recompute, dict) else {n: recompute for n in names}
    return {n: (stay.get(n, KEPT) if n in full else base.get(n, "none")) for n in names}


def kept_plans(req: SolveRequest, best: Plan, traces: dict, candidates, bisect: bool = True) -> list[Plan]:
    """Plans of ``best``'s candidate with its fully recomputed layers recomputed around their attention
    core (module docstring); ``candidates``: ``search._candidates``; ``traces``: as ``partial_plans``;
    ``bisect`` false: the all-turned probe only."""
    if best.candidate == "DDP layout":
        return []
    rec = best.memory_options.recompute
    names = layer_names(req.traced.gm)
    full = _full_layers(rec, names)
    if not full or not find_regions(req.traced.gm, choices_for(req.traced.gm, {n: "selective" for n in full})):
        return []           # no attention core in those layers: "except_attention" is "full" there
    # a pipeline runs ZeRO-1 at no cost in time (``zero_upgrade``): the probes hold more, so they take it.
    # Under AUTO a pipeline's all-turned probe is solved twice, with the "full" plan's parameter layout and
    # anew (that layout was chosen for less memory; a layout solved anew under the whole model's budget can
    # also come out slower: Llama 3 405B at 128K gains 12 % anew and 3 % pinned, at 8K 0.85 % pinned and
    # loses 10x anew); the bisection's keep that plan's, as ``partial_plans`` does (memory then falls with j)
    zero = 1 if best.pipeline is not None and req.opts.zero is None and best.memory_options.zero == 0 else None
    label = lambda j: f"recompute {KEPT} on {len(full) - j} of {len(names)} layers, full on {j}"   # noqa: E731
    probe = Probe(req, best, traces, candidates, zero=zero)
    out = probe.plans([_mapping(rec, names, full, 0)], label(0))
    if probe.pinned is not req.param_ann:
        out += Probe(req, best, traces, candidates, pin=False, zero=zero).plans([_mapping(rec, names, full, 0)],
                                                                               label(0) + ", layout anew")
    if not bisect or any(not p.memory_bound for p in out):
        return out
    return out + probe.bisect(len(full), lambda mid, j: ([_mapping(rec, names, full, j)], label(j)))


def kept_probes(req: SolveRequest, plans: list[Plan], traces: dict, candidates, rank_key) -> list[Plan]:
    """``kept_plans`` of the plans ``worth_probing`` names (the best with its bisection, the others the
    all-turned probe only), each while its estimate (module docstring) beats the best plan so far;
    ``rank_key``: the search's ranking."""
    if not any(_some_full(p.memory_options.recompute) for p in plans):
        return []           # nothing recomputes "full": no probe (and no need to find the cores)
    cores = attention_cores(req.traced.gm)
    progress = req.opts.progress
    found = min(plans, key=rank_key)
    out: list[Plan] = []
    for p in worth_probing(plans, rank_key, cores):
        if progress is not None and progress.out_of_time():
            break
        best = min(plans + out, key=rank_key)
        gain = core_share(p, cores) / 3
        if gain >= MIN_GAIN and (p is found or p.step_time * (1 - gain) < best.step_time):
            out += kept_plans(req, p, traces, candidates, bisect=p is found)
    return out


__all__ = ["attention_cores", "core_share", "kept_plans", "kept_probes", "worth_probing"]
