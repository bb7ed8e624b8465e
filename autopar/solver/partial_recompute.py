"""Partial recomputation in the search: "full" on some layers only (``graph/recompute_layers.py``).

``resolve_recompute_layers``: the user's ``recompute_layers=k`` becomes the ``{layer: "full"}``
mapping of ``k`` layers before the search (``recompute`` must be None or "full").

``partial_plans`` (AUTO/SEMI_AUTO, recomputation left to the search): when the fastest plan found
recomputes every layer ("full"), it re-plans that plan's candidate (its mesh, a pipeline's named
``pp`` mesh, its ZeRO stage and accumulation) with ``r`` of the ``L`` layers recomputed; with a
pipeline of ``pp`` stages ``r = k * pp`` (each stage its first ``k``, Megatron's block method; under
interleaved 1F1B also, as a second probe, each rank's ``k`` where their activations weigh most,
``recompute_placement``), so
``k`` runs over ``0 .. ceil(L / pp)``, without one ``r`` runs over ``0 .. L``. The rule: saved activations
fall linearly as ``r`` grows and the time grows with ``r``, so the best ``r`` is the smallest whose plan
fits without the cap shaping its layout or stage cut (``Plan.memory_bound``: a pipeline can often fit
any ``r`` by a skewed cut, which is slower); it is found by bisection over ``k``, ``k = 0`` ("none")
taken as not fitting freely and the top ("full") as fitting. A probe that fits freely moves the upper
end down, any other moves the lower end up. The probes are solved without the best-plan-so-far bound
(``SearchProgress.cutoff``): "cannot beat the best plan" would not say on which side the smallest
fitting count lies, and the answer would depend on the order plans were found in. At most
``ceil(log2(top))`` probes (3 for 126 layers on 16 stages, 7 for 126 layers without a pipeline). Every
probe that fits joins the plans (a memory-bound one too), and the usual ranking picks among them. A
1-D search, not a product with the other levers: those are the best "full" plan's.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

from autopar.core.context import ParallelMode
from autopar.graph.recompute_layers import layers_choice
from autopar.graph.recompute_regions import layer_names
from autopar.plan.plan import Plan, PlanError
from autopar.solver.accumulation import accumulated, microbatch_traced
from autopar.solver.recompute_placement import charged_layers
from autopar.solver.request import SolveRequest

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


def _choices(gm, best: Plan, per_stage: int, r: int) -> list[dict[str, str]]:
    """The ``r`` recomputed layers to probe: spread evenly (``layers_choice``) and, under interleaved
    1F1B, also ``per_stage`` per pipeline rank where their activations weigh most (``recompute_placement``:
    less memory, but the recomputing stages are the early ones, which can lengthen the schedule)."""
    out = [layers_choice(gm, r)]
    info = best.pipeline
    if info is not None and info.virtual_stages > 1:
        pp = best.mesh.shape[best.mesh.axis_names.index("pp")]
        charged = charged_layers(layer_names(gm), per_stage, pp, best.microbatches, best.schedule,
                                 info.virtual_stages)
        if charged != out[0]:
            out.append(charged)
    return out


def _pinned(best: Plan) -> dict:
    """``best``'s parameter placements on its axes other than ``pp``, as annotations (parameter name ->
    {axis: placement}): a pipeline's probes keep its layout and change only which layers recompute.
    Each probe's sub-mesh layout is otherwise solved anew under the whole model's budget (pp x the cap,
    ``pipeline_search``), where more saved activations can make it shard weights that the stage cut
    would hold whole; with the layout fixed, the bisection's premise holds: memory falls and time
    grows with r."""
    names = best.mesh.axis_names
    return {name: {a: p for a, p in zip(names, d.spec) if a != "pp"}
            for name, d in best.params.items() if d.kind == "parameter"}


def partial_plans(req: SolveRequest, best: Plan, traces: dict, candidates) -> list[Plan]:
    """Plans of ``best``'s candidate with ``r`` of the layers recomputed (module docstring).
    ``candidates``: ``search._candidates``; ``traces``: accumulation k -> the step traced at B/k."""
    if best.memory_options.recompute != "full" or best.candidate == "DDP layout":
        return []
    names = layer_names(req.traced.gm)
    if len(names) < 2:
        return []
    probe = Probe(req, best, traces, candidates)
    return probe.bisect(len(names), lambda mid, r: (
        _choices(probe.mb.gm, best, mid, r),
        f"recompute full on {r} of {len(names)} layers" + (f" ({mid} per stage)" if probe.pipeline else "")))


class Probe:
    """Re-plans of ``best``'s candidate (its mesh, a pipeline's named ``pp`` mesh, its ZeRO stage and
    accumulation; a pipeline's parameter layout pinned under AUTO, ``_pinned``) with another recompute
    choice, solved without the best-plan-so-far cutoff (``_unbounded``)."""

    def __init__(self, req: SolveRequest, best: Plan, traces: dict, candidates, pin: bool = True,
                 zero: int | None = None):
        self.req, self.best, self.candidates = req, best, candidates
        self.zero = best.memory_options.zero if zero is None else zero
        self.k = best.memory_options.accumulation
        self.pipeline = best.pipeline is not None
        if self.k not in traces:
            traces[self.k] = microbatch_traced(req.traced, self.k, req.retracer)
        self.mb = traces[self.k]
        self.step = best.mesh.shape[best.mesh.axis_names.index("pp")] if self.pipeline else 1
        self.pinned = ({**_pinned(best), **req.param_ann} if pin and self.pipeline and req.mode == ParallelMode.AUTO
                       else req.param_ann)

    def out_of_time(self) -> bool:
        progress = self.req.opts.progress
        return progress is not None and progress.out_of_time()

    def bisect(self, count: int, probe_at) -> list[Plan]:
        """The bisection over ``mid`` in 0 .. ceil(count / step), 0 taken as not fitting freely and the top
        as fitting (``best``'s own choice): ``probe_at(mid, r)`` with ``r = min(count, mid * step)`` gives
        (recompute choices, label) of a probe; one that fits freely (``Plan.memory_bound`` false) moves the
        upper end down, any other the lower end up. Every probe's plans are returned."""
        top = -(-count // self.step)
        lo, hi, out = 0, top, []
        for _ in range(math.ceil(math.log2(max(top, 1)))):
            if hi - lo <= 1 or self.out_of_time():
                break
            mid = (lo + hi) // 2
            got = self.plans(*probe_at(mid, min(count, mid * self.step)))
            out += got
            if any(not p.memory_bound for p in got):
                hi = mid
            else:
                lo = mid
        return out

    def plans(self, choices: list, label: str) -> list[Plan]:
        """The plans of each recompute choice in ``choices`` (``label`` for the progress line)."""
        progress, k = self.req.opts.progress, self.k
        if progress is not None:
            progress.enter(f"ZeRO-{self.zero}, {label}, accumulation {k}")
        got = []
        for choice in choices:
            probe = self.req.replace(traced=self.mb, mesh=self.best.mesh, param_ann=self.pinned).with_options(
                recompute=choice, zero=self.zero)
            try:
                with _unbounded(progress):
                    found, _, _ = self.candidates(probe, pipelines=self.pipeline, microbatches=k)
            except PlanError:
                found = []
            got += [accumulated(p, k, self.req.traced, self.mb) for p in found
                    if (p.pipeline is not None) == self.pipeline]
        return got
