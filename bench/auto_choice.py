"""Does AUTO pick the fastest plan? Measure every plan it considered on 4 ranks.

    .venv/bin/python bench/auto_choice.py [--reps 12] [--calibrate PROFILE]

For three models (a wide MLP, a deep narrow transformer, an embedding-heavy transformer) the
planner's candidates are built by the functions ``make_plans`` calls: the pp=1 meshes of
``candidate_meshes`` (solved with ``solve_on_mesh``), DDP's layout (``ddp_candidate``: the DATA
mode plan), every pipeline candidate of ``pipeline_candidates`` (``plan_pipeline``: pp, sub-mesh,
microbatches and schedule), plus pure TP (``("tp",)`` mesh) unless AUTO's 1-D solve is that
layout already. Each plan is applied
with HYBRID (``parallelize(plan=...)``) and timed, all of them interleaved. The figure: where
AUTO's choice ranks among the measured step times, and its time over the fastest (target <= 1.10).
Then it runs AUTO as shipped on the same ranks (``parallelize(mode="auto")`` with the context's
defaults: the ranks time its best predicted plans, ``autotune_top_k`` = 6 within ``autotune_slack``
= 1.5x of the best, ``autotune_steps`` = 8, and keep the fastest) and ranks that choice the same way;
``--autotune K`` / ``--autotune-steps N`` override the two settings (``--autotune 0``: skip).
``--calibrate PROFILE`` plans with a calibration profile of this machine (measured first when
the file is missing; ``autopar.cost_models.calibrate``) instead of the "cpu" preset's defaults.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys

from common import ROOT, interleaved  # noqa: F401  (ROOT puts the repo on sys.path)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import autopar  # noqa: E402
from autopar.modules.autotune import layout_key, plan_label  # noqa: E402
from autopar.core.context import ParallelMode  # noqa: E402
from autopar.graph.retrace import Retracer  # noqa: E402
from autopar.runtime.launch import RankPool  # noqa: E402
from autopar.solver.pipeline_search import optimizer_time, pipeline_candidates, plan_pipeline  # noqa: E402
from autopar.solver.search import PlanOptions, ddp_candidate, candidate_meshes, solve_on_mesh  # noqa: E402
from autopar.solver.request import SolveRequest  # noqa: E402
from autopar.frontend.trace import trace  # noqa: E402
from examples.models import GPT, MLP, lm_loss  # noqa: E402

WORLD = 4
MODELS = {
    "wide-mlp": (functools.partial(MLP, d_in=256, hidden=1024, d_out=16, depth=4), F.cross_entropy, "vector", 64),
    "deep-narrow": (functools.partial(GPT, vocab=256, hidden=64, heads=4, layers=8, seq=32, qkv_bias=False), lm_loss,
                    "tokens", 16),
    "embedding-heavy": (functools.partial(GPT, vocab=16384, hidden=64, heads=4, layers=4, seq=32, qkv_bias=False),
                        lm_loss, "tokens", 16),
}


def _batch(kind: str, batch: int):
    g = torch.Generator().manual_seed(1)
    if kind == "vector":
        return torch.randn(batch, 256, generator=g), torch.randint(0, 16, (batch,), generator=g)
    return torch.randint(0, 256, (batch, 32), generator=g), torch.randint(0, 256, (batch, 32), generator=g)


def _inputs(name: str):
    factory, loss_fn, kind, batch = MODELS[name]
    x, y = _batch(kind, batch)
    return factory, loss_fn, x, y


def _label(p) -> str:
    return f"{p.mode.name:<9} {plan_label(p)}"


def considered_plans(name: str, opts: PlanOptions) -> tuple[list, int]:
    """Every candidate plan, built by the functions make_plans uses, and the index of AUTO's
    choice (the least predicted ``step_time`` among make_plans' own candidates, as make_plans picks)."""
    torch.manual_seed(0)
    factory, loss_fn, x, y = _inputs(name)
    model = factory()
    traced = trace(model, (x,), loss_fn, y)
    retracer = Retracer(model, (x,), loss_fn, y)
    mesh = autopar.Mesh(WORLD)
    plans = []
    for cand in pipeline_candidates(traced, mesh, ParallelMode.AUTO, {})[0]:
        try:
            plans.append(plan_pipeline(traced, cand, ParallelMode.AUTO, opts, {}, {}, retracer))
        except ValueError:
            continue
    for m in candidate_meshes(mesh):
        plans.append(solve_on_mesh(SolveRequest(traced, None, m, ParallelMode.AUTO, opts)))
    plans += ddp_candidate(traced, mesh, opts, [])          # DATA mode's plan, one of AUTO's candidates
    for p in plans:
        p.optimizer_time = optimizer_time(p, opts.optimizer)
    chosen = min(range(len(plans)), key=lambda i: plans[i].step_time)
    pure_tp = solve_on_mesh(SolveRequest(traced, None, autopar.Mesh((WORLD,), axis_names=("tp",)), ParallelMode.AUTO,
                                         opts))
    if layout_key(pure_tp) not in {layout_key(p) for p in plans}:     # one plan under two mesh names is timed once
        pure_tp.optimizer_time = optimizer_time(pure_tp, opts.optimizer)
        plans.append(pure_tp)
    return plans, chosen


_STEPS: dict = {}


def _build(rank: int, name: str, plan_jsons: list[str]) -> dict:
    factory, loss_fn, x, y = _inputs(name)
    _STEPS.clear()
    failed = {}
    for i, text in enumerate(plan_jsons):
        plan = autopar.Plan.from_json(text)
        torch.manual_seed(0)
        try:
            pm = autopar.parallelize(factory(), plan.mesh, example_inputs=(x,), loss_fn=loss_fn, example_target=y,
                                     plan=plan)
        except Exception as err:  # noqa: BLE001 - a plan that cannot be built is reported, not timed
            failed[i] = f"{type(err).__name__}: {err}"
            continue
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)

        def step(pm=pm, opt=opt):
            pm.step(x, target=y)
            opt.step()
            opt.zero_grad()

        _STEPS[str(i)] = step
    return failed


def _measure(rank: int, reps: int) -> dict:
    return interleaved(dict(_STEPS), reps, warmup=1, shuffle=True)


def _autotuned(rank: int, name: str, top_k: int | None, steps: int | None) -> tuple[str, list]:
    """AUTO (the context's autotune settings unless given): the label of the plan the ranks chose, and the trials."""
    factory, loss_fn, x, y = _inputs(name)
    torch.manual_seed(0)
    autopar.reset_auto_parallel_context()
    autopar.set_auto_parallel_context(**{k: v for k, v in (("autotune_top_k", top_k), ("autotune_steps", steps))
                                         if v is not None})
    try:
        pm = autopar.parallelize(factory(), autopar.Mesh(WORLD), example_inputs=(x,), loss_fn=loss_fn,
                                 example_target=y, mode="auto")
    finally:
        autopar.reset_auto_parallel_context()
    return plan_label(pm.plan), [dataclasses.asdict(t) for t in pm.plan.autotune]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--autotune", type=int, default=None, metavar="K",
                    help="autotune_top_k of the AUTO run on the ranks (default: the shipped default; 0: skip the run)")
    ap.add_argument("--autotune-steps", type=int, default=None, metavar="N",
                    help="autotune_steps (timed steps per plan; default: the shipped default)")
    ap.add_argument("--calibrate", metavar="PROFILE", default=None,
                    help="plan with the calibration profile at PROFILE (measured first, quick, if missing)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    opts = PlanOptions()
    if args.calibrate:
        from autopar.cost_models.calibrate import calibrate
        from autopar.cost_models.profile import load_profile

        os.environ["AUTOPAR_PROFILE"] = args.calibrate
        if load_profile() is None:
            calibrate(args.calibrate, quick=True)
        print(f"planning with the calibration profile {args.calibrate}")
    pool = RankPool(WORLD, timeout_s=600)
    summary = []
    try:
        for name in args.models.split(","):
            plans, chosen = considered_plans(name, opts)
            failed = pool.run(_build, name, [p.to_json(indent=None) for p in plans])[0]
            times = pool.run(_measure, args.reps)[0]
            med = [statistics.median(times[str(i)]) if str(i) in times else float("inf") for i in range(len(plans))]
            order = sorted(range(len(plans)), key=med.__getitem__)
            pred_order = sorted(range(len(plans)), key=lambda i: plans[i].step_time)
            print(f"\n{name}: {len(plans)} plans, {args.reps} interleaved rounds on {WORLD} ranks")
            print(f"  {'plan':<62} {'predicted ms':>12} {'pred rank':>9} {'measured ms':>11} {'rank':>5}"
                  "   (predicted = plan.step_time, optimizer included)")
            for i in order:
                mark = "  <- AUTO" if i == chosen else ""
                print(f"  {_label(plans[i]):<62} {plans[i].step_time * 1e3:>12.3f} {pred_order.index(i) + 1:>9} "
                      f"{med[i] * 1e3:>11.1f} {order.index(i) + 1:>5}{mark}", flush=True)
                if i in failed:
                    print(f"      could not be built: {failed[i][:160]}")
            ratio = med[chosen] / med[order[0]]
            summary.append((name, "predicted", order.index(chosen) + 1, len(plans), ratio, _label(plans[chosen])))
            if args.autotune is None or args.autotune > 1:
                label, trials = pool.run(_autotuned, name, args.autotune, args.autotune_steps)[0]
                how = "shipped" if args.autotune is None and args.autotune_steps is None else f"autotune {args.autotune}"
                tuned = next((i for i in range(len(plans)) if plan_label(plans[i]) == label and plans[i].mode
                              == ParallelMode.AUTO), None)
                print(f"  AUTO as run ({how}): "
                      + "; ".join(f"{t['label']} predicted {t['predicted'] * 1e3:.1f} ms, measured "
                                  f"{(t['measured'] or float('inf')) * 1e3:.1f} ms{' (chosen)' if t['chosen'] else ''}"
                                  for t in trials))
                if tuned is None:
                    print(f"  the autotuned choice {label} is not among the measured plans")
                else:
                    summary.append((name, how, order.index(tuned) + 1, len(plans),
                                    med[tuned] / med[order[0]], _label(plans[tuned])))
    finally:
        pool.close()
    print("\nAUTO's choice: measured rank and time over the fastest measured plan (target <= 1.10)")
    for name, how, rank, n, ratio, label in summary:
        print(f"  {name:<16} {how:<11} rank {rank}/{n}  {ratio:.3f}×  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
