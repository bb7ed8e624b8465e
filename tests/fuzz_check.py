"""The property a fuzz ``Case`` (``fuzz_cases.py``) must satisfy, and running one case.

A case either

* **trains**: every rank's losses, gathered gradients and updated parameters equal the single-device
  run (``oracle.reference_run``, same seed, batch, optimizer, micro-batches and clipping) at 1e-5
  relative in fp32 (``oracle.assert_same_training``); or, where that bar fails, they are as close
  to the exact result (the same training in float64) as fp32 training in torch itself gets, measured
  in the same case (``oracle.assert_within_torch_noise``, 4x the furthest of: the one-device fp32
  run, torch DDP over 2 or 4 ranks with each step cut into the plan's microbatches, one device
  accumulating over those microbatches, and for a plan that splits weights one device with every
  linear layer summed in halves as a Megatron split does). Reordered sums (data, tensor and pipeline parallelism,
  accumulation) move an ill-conditioned model's fp32 gradients past 1e-5: a transformer with
  LayerNorm over 4 features is itself 2e-5 from its float64 run on one device, and DDP lands 1e-6
  from it at one step and 4e-5 at the next, so one torch run alone is a poor bar. Under mixed
  precision the single-device run uses the same bf16 policy and the bar is 2x the furthest of torch
  FSDP2 (same policy, 2 and 4 ranks) and one device accumulating from it (docs/testing.md), or, for
  a plan that rounds where they do not (bf16 partial products of a tensor-parallel matmul summed),
  2x the furthest of them and the bf16 one-device run from the float64 run. The plan must also
  use the memory options the case fixed; or
* is **refused**: every rank (or the HYBRID plan's ``autopar.plan`` call) raises an error,
  of an autopar error type, raised by autopar's own code with a message (never a raw torch
  exception, never a hang, never one rank failing alone).

Anything else is a **failure**. ``check_case(case, run_ranks)`` runs a case with a ``run_ranks(n,
fn, *args)`` (the suite's shared pool, or bench/fuzz.py's) and returns its ``Outcome``.
"""
from __future__ import annotations

import functools
import os
import time
import traceback
from dataclasses import dataclass

import autopar
from autopar.core.errors import CheckpointError, RankMismatchError, TraceError
from autopar.plan.plan import PlanError
from fuzz_cases import Case
from fuzz_models import batch_of, build, loss_of
from oracle import assert_same_training, assert_within_torch_noise, distance, parallel_run, reference_run
from torch_baseline import split_linear_run, splits, torch_dp_run

DEVICE = "a100-80gb"            # plans do not depend on this machine's calibration (docs/testing.md)
AUTOPAR_ERRORS = (PlanError, TraceError, RankMismatchError, CheckpointError, ValueError, TypeError)
SOLVER_SECONDS = 3.0            # per CP-SAT solve: the fuzzer tests lowering, not plan quality (a capped SEMI_AUTO
                                # search of a toy model took 78 s at the default 10 s, past the ranks' timeout)
TORCH_FACTOR = 2.0              # mixed precision: at most this x torch's distance (test_mixed_precision.py)
EXACT_FACTOR = 4.0              # fp32 vs float64: two summation orders land up to 2x apart (docs/testing.md)
_AUTOPAR_DIR = os.path.dirname(os.path.abspath(autopar.__file__))


@dataclass
class Outcome:
    case: Case
    status: str                 # "trained", "refused" or "failed"
    detail: str = ""            # the refusal's message, or what failed
    plan: str = ""              # degrees, microbatches and memory options of the plan that ran
    bar: str = ""               # "1e-5", "fp32 noise (...)" or "2x torch bf16 (...)": which runs set it
    seconds: float = 0.0


def error_record(err: BaseException) -> dict:
    """Type, message, where it was raised, and whether it is autopar's own: an autopar error type raised
    by a ``raise`` statement in autopar's code, with a message (a ValueError that a builtin such as
    ``min()`` raised inside autopar is not: "min() arg is an empty sequence" says nothing to a user)."""
    frames = traceback.extract_tb(err.__traceback__)
    last = frames[-1] if frames else None
    own = (last is not None and os.path.abspath(last.filename).startswith(_AUTOPAR_DIR)
           and (last.line or "").lstrip().startswith("raise"))
    return {"type": type(err).__name__, "message": str(err), "file": last.filename if last else "",
            "autopar": isinstance(err, AUTOPAR_ERRORS) and own and len(str(err)) >= 20,
            "traceback": "".join(traceback.format_exception(type(err), err, err.__traceback__))[-3000:]}


def annotate(case: Case, model=None) -> None:
    """The case's SEMI_AUTO annotations: weight placements and pipeline stage tags."""
    for a in case.shards:
        place = autopar.Replicate() if a.dim is None else autopar.Shard(a.dim)
        tensors = {"weight": {a.axis: place}}
        if a.bias:
            tensors["bias"] = {a.axis: autopar.Shard(0)}
        autopar.shard(a.module, **tensors)
    for module, stage in case.stages:
        autopar.pipeline_stage(module, stage)


def apply_options(case: Case) -> None:
    """The memory options the case fixes, and a short solver time limit (SOLVER_SECONDS)."""
    opts = {k: getattr(case, k) for k in ("zero", "recompute", "accumulation") if getattr(case, k) is not None}
    autopar.set_auto_parallel_context(solver_time_limit=SOLVER_SECONDS, **opts)


def _mesh(case: Case, cap_gb: float | None = None) -> autopar.Mesh:
    return autopar.Mesh(case.shape, axis_names=case.axis_names, device=DEVICE, memory_gb=cap_gb)


def memory_cap(case: Case) -> float | None:
    """GiB per device: ``case.memory_fraction`` x the peak of the model's one-device plan (None: no cap)."""
    if case.memory_fraction is None:
        return None
    x, y = batch_of(case.model, case.batch)
    one = autopar.plan(build(case.model), autopar.Mesh(1, device=DEVICE), example_inputs=(x.chunk(case.micro)[0],),
                       loss_fn=loss_of(case.model), example_target=y.chunk(case.micro)[0], mode="stand_alone",
                       mixed_precision=case.mixed_precision)
    return case.memory_fraction * max(one.memory_per_device) / 2**30


def hybrid_plan(case: Case, cap_gb: float | None) -> str:
    """The plan a HYBRID case applies: made by ``autopar.plan`` in the case's ``source`` mode, as JSON."""
    autopar.reset_auto_parallel_context()
    autopar.clear_annotations()
    try:
        apply_options(case)
        x, y = batch_of(case.model, case.batch)
        xs, ys = x.chunk(case.micro)[0], y.chunk(case.micro)[0]
        if case.source in ("semi_auto", "auto"):
            annotate(case)
        return autopar.plan(build(case.model), _mesh(case, cap_gb), example_inputs=(xs,), loss_fn=loss_of(case.model),
                            example_target=ys, mode=case.source, mixed_precision=case.mixed_precision).to_json()
    finally:
        autopar.reset_auto_parallel_context()
        autopar.clear_annotations()


def rank_job(rank: int, case: Case, plan_json: str | None, cap_gb: float | None) -> dict:
    """One rank's training through autopar: ``{"run": oracle result}`` or ``{"error": error_record}`` for an
    autopar error. Any other error is raised: the pool then reports it and replaces its ranks, whose
    process group it may have left mid-collective."""
    try:
        apply_options(case)
        x, y = batch_of(case.model, case.batch)
        kw = {}
        if case.mode == "hybrid":
            kw["plan"], mode = autopar.Plan.from_json(plan_json), None
        else:
            mode = case.mode
            if case.mixed_precision:
                kw["mixed_precision"] = case.mixed_precision
        setup = functools.partial(annotate, case) if case.mode in ("semi_auto", "auto") else None
        return {"run": parallel_run(rank, functools.partial(build, case.model), loss_of(case.model), x, y,
                                    _mesh(case, cap_gb), mode, steps=case.steps, optim=case.optim, micro=case.micro,
                                    clip=case.clip, setup=setup, **kw)}
    except Exception as err:  # noqa: BLE001 - judged by the parent (check_case)
        rec = error_record(err)
        if not rec["autopar"]:
            raise
        return {"error": rec}


def plan_summary(plan: autopar.Plan) -> str:
    """Degrees, microbatches, schedule, memory options, how many parameters are split, collectives."""
    d = plan.degrees
    split = sum(any(isinstance(p, autopar.Shard) for p in dec.spec) for dec in plan.params.values())
    return (f"dp={d['dp']} tp={d['tp']} pp={d['pp']} mb={plan.microbatches} {plan.schedule}; "
            f"{plan.memory_options.summary()}; {split}/{len(plan.params)} params split, "
            f"{len(plan.collectives(0))} collectives")


def _forced_options_kept(case: Case, plan: autopar.Plan) -> str:
    """What the plan changed of the options the case fixed ('' when nothing)."""
    mo, wrong = plan.memory_options, []
    if case.zero is not None and mo.zero != case.zero:
        wrong.append(f"zero={case.zero} asked, plan has {mo.zero}")
    if case.recompute is not None and mo.recompute != case.recompute:
        wrong.append(f"recompute={case.recompute!r} asked, plan has {mo.recompute!r}")
    if case.accumulation is not None and mo.accumulation != case.accumulation:
        wrong.append(f"accumulation={case.accumulation} asked, plan has {mo.accumulation}")
    if mo.mixed_precision != case.mixed_precision:
        wrong.append(f"mixed_precision={case.mixed_precision!r} asked, plan has {mo.mixed_precision!r}")
    return "; ".join(wrong)


def _torch_jobs(case: Case, plan: autopar.Plan) -> list[tuple[int, int]]:
    """(ranks, accumulate) of torch's data-parallel runs: on 2 and on 4 ranks (the plan's dp degree
    first) where the batch splits, each micro-batch cut as the plan cuts it (accumulation x pipeline
    microbatches) where the batch allows, else whole."""
    inner = plan.memory_options.accumulation * plan.microbatches
    out = []
    for w in dict.fromkeys([plan.degrees["dp"], 2, 4]):
        acc = next((a for a in dict.fromkeys([inner, 1]) if splits(case.batch, case.micro, w, a)), None)
        if w in (2, 4) and acc is not None:
            out.append((w, acc))
    return out


def _torch_runs(case: Case, plan: autopar.Plan, run_ranks) -> tuple[list[dict], str]:
    """torch's own runs of the case's job, and what they were: DDP (FSDP2 under bf16) on 2 and 4 ranks
    (``_torch_jobs``); where the plan cuts each step into microbatches (accumulation, a pipeline),
    one device accumulating over the same microbatches; where it splits a weight, one device with
    every linear layer summed as a Megatron split would (``torch_baseline.split_linear_run``)."""
    model_fn, loss_fn = functools.partial(build, case.model), loss_of(case.model)
    x, y = batch_of(case.model, case.batch)
    common = dict(steps=case.steps, optim=case.optim, micro=case.micro, clip=case.clip,
                  mixed_precision=case.mixed_precision)
    runs, names = [], []
    for w, acc in _torch_jobs(case, plan):
        runs.append(run_ranks(w, torch_dp_run, model_fn, loss_fn, x, y, accumulate=acc, **common)[0])
        names.append(f"{'FSDP2' if case.mixed_precision else 'DDP'} on {w} ranks x {acc} microbatches")
    inner = plan.memory_options.accumulation * plan.microbatches
    if inner > 1 and splits(case.batch, case.micro, 1, inner):
        runs.append(reference_run(model_fn, loss_fn, x, y, accumulate=inner, **common))
        names.append(f"one device x {inner} microbatches")
    if any(isinstance(p, autopar.Shard) for d in plan.params.values() for p in d.spec):
        runs.append(split_linear_run(model_fn, loss_fn, x, y, **common))
        names.append("one device, linear layers split in halves")
    return runs, ", ".join(names)


def _exact_run(case: Case) -> dict:
    """The case's single-device training in float64: the exact result fp32 and bf16 runs approximate."""
    x, y = batch_of(case.model, case.batch)
    return reference_run(lambda: build(case.model).double(), loss_of(case.model),
                         x.double() if x.is_floating_point() else x, y, steps=case.steps, optim=case.optim,
                         micro=case.micro, clip=case.clip)


def _judge_bf16(case: Case, runs: list[dict], ref: dict, torch_runs: list[dict], names: str) -> tuple[str, str]:
    """bf16: within 2x torch's distance from the bf16 single-device run (test_mixed_precision.py's bar),
    or, where the plan rounds where torch's data parallelism does not (a tensor-parallel sum of bf16
    partial products), no further from the exact run than 2x the furthest of torch's bf16 runs."""
    ours, theirs = max(distance(r, ref) for r in runs), max(distance(t, ref) for t in torch_runs)
    if ours <= TORCH_FACTOR * theirs:
        return "", f"2x torch bf16 ({names})"
    exact = _exact_run(case)
    ours_x, theirs_x = max(distance(r, exact) for r in runs), max(distance(t, exact) for t in [ref, *torch_runs])
    if ours_x <= TORCH_FACTOR * theirs_x:
        return "", f"bf16 noise vs float64 (one device, {names})"
    return (f"{ours:.3e} from the single-device bf16 run (torch {theirs:.3e}); {ours_x:.3e} from the float64 run "
            f"(torch's furthest bf16 run {theirs_x:.3e})", f"bf16 ({names})")


def judge(case: Case, runs: list[dict], run_ranks) -> tuple[str, str]:
    """('' or what failed, the bar used) for the ranks' training results."""
    x, y = batch_of(case.model, case.batch)
    ref = reference_run(functools.partial(build, case.model), loss_of(case.model), x, y, steps=case.steps,
                        optim=case.optim, micro=case.micro, clip=case.clip, mixed_precision=case.mixed_precision)
    plan = autopar.Plan.from_json(runs[0]["plan"])
    if case.mixed_precision:
        return _judge_bf16(case, runs, ref, *_torch_runs(case, plan, run_ranks))
    try:
        for rank, r in enumerate(runs):
            assert_same_training(ref, r, 1e-5, f"rank {rank}")
        return "", "1e-5"
    except AssertionError as strict:
        torch_runs, names = _torch_runs(case, plan, run_ranks)
        exact = _exact_run(case)
        try:
            for rank, r in enumerate(runs):
                assert_within_torch_noise(exact, r, [ref, *torch_runs], f"rank {rank}", factor=EXACT_FACTOR)
        except AssertionError as noisy:
            return f"against the float64 run: {noisy} (1e-5 bar: {strict})", f"fp32 noise (one device, {names})"
        return "", f"fp32 noise (one device, {names})"


def _refusal(errors: list[dict], n: int) -> str | None:
    """Rank 0's message when every rank raised an autopar error (None otherwise). The other ranks may
    say it differently: a planning error is raised on rank 0 and reported by the others as
    "planning failed on rank 0: ..." (``api.parallelize``)."""
    if len(errors) == n and all(e["autopar"] for e in errors):
        return f"{errors[0]['type']}: {errors[0]['message']}"
    return None


def check_case(case: Case, run_ranks) -> Outcome:
    """Run ``case`` and judge it by the property of the module docstring."""
    t0 = time.perf_counter()

    def done(status, detail="", plan="", bar=""):
        return Outcome(case, status, detail, plan, bar, time.perf_counter() - t0)

    plan_json = None
    cap_gb = memory_cap(case)
    if case.mode == "hybrid":
        try:
            plan_json = hybrid_plan(case, cap_gb)
        except Exception as err:  # noqa: BLE001 - judged here
            rec = error_record(err)
            if rec["autopar"]:
                return done("refused", f"{rec['type']}: {rec['message']}")
            return done("failed", f"autopar.plan for the HYBRID plan raised; not a clear autopar refusal:\n"
                                  f"{rec['traceback']}")
    try:
        results = run_ranks(case.ranks, rank_job, case, plan_json, cap_gb)
    except autopar.RankError as err:        # a raw error, a hang (pool timeout) or a rank that died
        text = str(err)
        if any(k in text for k in ("did not finish", "was killed by signal", "exited with code")):
            return done("failed", f"ranks did not all return: {text[-3000:]}")
        return done("failed", f"ranks raised; not a clear autopar refusal on every rank:\n{text[-3000:]}")
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        refusal = _refusal(errors, case.ranks)
        if refusal is not None:
            return done("refused", refusal)
        worst = next((e for e in errors if not e["autopar"]), errors[0])
        return done("failed", f"{len(errors)} of {case.ranks} ranks raised; not a clear autopar refusal on every "
                              f"rank:\n{worst['traceback']}")
    runs = [r["run"] for r in results]
    plan = autopar.Plan.from_json(runs[0]["plan"])
    changed = _forced_options_kept(case, plan)
    if changed:
        return done("failed", f"the plan did not keep the options the case fixed: {changed}", plan_summary(plan))
    msg, bar = judge(case, runs, run_ranks)
    return done("failed" if msg else "trained", msg, plan_summary(plan), bar)
