"""Partial recomputation in the search: "full" on some layers only (``graph/recompute_layers.py``).

``resolve_recompute_layers``: the user's ``recompute_layers=k`` becomes the ``{layer: "full"}``
mapping of ``k`` layers before the search (``recompute`` must be None or "full").

``partial_plans`` (AUTO/SEMI_AUTO, recomputation left to the search): when the fastest plan found
recomputes every layer ("full"), it re-plans that plan's candidate (its mesh, a pipeline's named
``pp`` mesh, its ZeRO stage and accumulation) with ``r`` of the ``L`` layers recomputed. The rule: saved
activations fall linearly as ``r`` grows and the time grows with ``r``, so the best ``r`` is the
smallest that fits (the most layers kept); it is found by bisection over ``r`` in ``(0, L)``, ``r = 0``
("none") taken as not fitting and ``r = L`` ("full") as fitting. A probe that fits moves the upper end
down, one that does not fit moves the lower end up. The probes are solved without the best-plan-so-far
bound (``SearchProgress.cutoff``): "cannot beat the best plan" would not say on which side of ``r`` the
smallest fitting count lies, and the answer would depend on the order plans were found in. At most
``MAX_PROBES`` probes (``ceil(log2 L)``: 7 for 126 layers). Every probe that fits joins the plans,
so a probe whose cut the cap skewed loses to a neighbour by the usual ranking. A 1-D search, not a
product with the other levers: those are the best "full" plan's.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

from autopar.core.context import ParallelMode
from autopar.graph.recompute_layers import layers_choice
from autopar.graph.recompute_regions import layer_names
from autopar.plan.plan import Plan, PlanError
from autopar.solver.accumulation import accumulated, microbatch_traced
from autopar.solver.request import SolveRequest

MAX_PROBES = 8


def resolve_recompute_layers(req: SolveRequest) -> SolveRequest:
    """``req`` with ``opts.recompute_layers`` turned into the ``{layer: "full"}`` mapping it names."""
    opts = req.opts
    k = opts.recompute_layers
    if k is None:
        return req
    if opts.recompute not in (None, "full"):
        raise PlanError(f"recompute_layers={k} recomputes whole layers ('full') but recompute={opts.recompute!r}; "
                        "leave recompute unset (or 'full') with recompute_layers, or drop recompute_layers")
    names = layer_names(req.traced.gm)
    if not names:
        raise PlanError(f"recompute_layers={k}: this model has no repeated layers (container.<index> modules, e.g. "
                        "an nn.ModuleList of blocks) to recompute; use recompute='full' or 'selective' instead")
    if k > len(names):
        raise PlanError(f"recompute_layers={k} is more than the model's {len(names)} repeated layers "
                        f"({names[0]} .. {names[-1]}); use at most {len(names)} (that is recompute='full')")
    return req.with_options(recompute=layers_choice(req.traced.gm, k), recompute_layers=None)


def applies(req: SolveRequest) -> bool:
    """Whether the search may try partial recomputation: AUTO or SEMI_AUTO with recomputation free."""
    return req.opts.recompute is None and req.mode in (ParallelMode.AUTO, ParallelMode.SEMI_AUTO)


@contextmanager
def _unbounded(progress):
    """``progress`` gives no cutoff (``SearchProgress.cutoff`` is None while it keeps unboundedly many)."""
    if progress is None:
        yield
        return
    keep = progress.keep
    progress.keep = 2**62
    try:
        yield
    finally:
        progress.keep = keep
        progress.kept_times = progress.kept_times[:keep]


def partial_plans(req: SolveRequest, best: Plan, traces: dict, candidates) -> list[Plan]:
    """Plans of ``best``'s candidate with ``r`` of the layers recomputed (module docstring).
    ``candidates``: ``search._candidates``; ``traces``: accumulation k -> the step traced at B/k."""
    if best.memory_options.recompute != "full" or best.candidate == "DDP layout":
        return []
    names = layer_names(req.traced.gm)
    if len(names) < 2:
        return []
    progress = req.opts.progress
    k = best.memory_options.accumulation
    pipeline = best.pipeline is not None
    if k not in traces:
        traces[k] = microbatch_traced(req.traced, k, req.retracer)
    mb = traces[k]
    lo, hi, out = 0, len(names), []
    for _ in range(min(MAX_PROBES, math.ceil(math.log2(len(names))))):
        if hi - lo <= 1 or (progress is not None and progress.out_of_time()):
            break
        r = (lo + hi) // 2
        if progress is not None:
            progress.enter(f"ZeRO-{best.memory_options.zero}, recompute full on {r} of {len(names)} layers, "
                           f"accumulation {k}")
        probe = req.replace(traced=mb, mesh=best.mesh).with_options(recompute=layers_choice(mb.gm, r),
                                                                 zero=best.memory_options.zero)
        try:
            with _unbounded(progress):
                got, _, _ = candidates(probe, pipelines=pipeline, microbatches=k)
        except PlanError:
            got = []
        got = [accumulated(p, k, req.traced, mb) for p in got if (p.pipeline is not None) == pipeline]
        out += got
        if got:
            hi = r
        else:
            lo = r
    return out
