"""What the user reads when no candidate fits the per-device memory cap.

Every failed candidate (a mesh factorisation under one set of memory options) keeps the error
of its intra-op solve; where the solver found its smallest assignment, the error carries that
assignment's per-device bytes by kind (``mesh_solve.memory_parts``). The message names the
candidate with the least memory, its breakdown, and an estimate of the device count that fits:

    N' = n · 2^j,  the least j >= 1 with  S · n / N' + 1.1 a + i <= cap,

where S is the least training state (parameters, gradients, optimizer state, gathered weights) of
any candidate on each of the n devices (split further by ZeRO-3 or tensor parallelism), ``a``
the least activations and transients of a microbatch of one row per device (accumulation and
recomputation shrink them that far; ``_more_devices``) and ``i`` the step's inputs. ``j`` is capped where the batch runs out of rows. It is an
estimate: the message says so (``tests/unit/test_zero_search_plans.py`` checks that it fits).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from autopar.graph.recompute_layers import recompute_label
from autopar.cost_models.memory import training_state_parts
from autopar.core.units import human_bytes
from autopar.plan.plan import CandidateError, PlanError
from autopar.solver.inter_op import StageMemoryError
from autopar.solver.intra_op import SolverTimeoutError


@dataclass
class Failure:
    """A candidate that did not fit: its mesh, its memory options ("" for none), the solver's error."""

    mesh: object
    note: str
    error: Exception

    def __str__(self) -> str:
        return f"{self.note}: {self.error}" if self.note else str(self.error)

    @property
    def breakdown(self) -> dict | None:
        return getattr(self.error, "breakdown", None)


class StageFitError(PlanError):
    """A pipeline candidate no stage partition fits: its mesh, the cap and the per-device ``breakdown``
    of its smallest partition's fullest rank (``stage_fit_error``)."""

    def __init__(self, message: str, mesh, cap: float, breakdown: dict, options: str):
        super().__init__(message)
        self.mesh, self.cap, self.breakdown, self.options = mesh, cap, breakdown, options


def stage_fit_error(message: str, errors: list, sub_breakdown: dict | None, mesh, cap: float,
                    opts) -> StageFitError | None:
    """The StageFitError of a pipeline candidate whose partitions failed with ``errors`` (None when none
    failed for memory). The stage's training state is split into parameters, gradients and optimizer
    state in the proportions of one fp32-stored parameter under ``opts.precision`` (exact for a model of
    one dtype); the sub-plan's transients are added as ``_stage_memory`` does (its gathered parameter
    copies are in the stage's activations)."""
    tight = [e for e in errors if isinstance(e, StageMemoryError)]
    if not tight:
        return None
    best = min(tight, key=lambda e: e.state + e.activations)
    parts = training_state_parts(1.0, torch.float32, opts.optimizer, opts.precision)
    breakdown = {k: best.state * v / sum(parts) for k, v in zip(("parameters", "gradients", "optimizer state"), parts)}
    breakdown["activations"] = best.activations
    if (sub_breakdown or {}).get("transient"):
        breakdown["transient"] = sub_breakdown["transient"]
    options = f"recompute {recompute_label(opts.recompute)}" if opts.recompute not in (None, "none") else ""
    return StageFitError(message, mesh, cap, breakdown, options)


def pipeline_nothing_fits(mesh, failures: list[tuple[str, Exception]], batch: int) -> PlanError | None:
    """``nothing_fits`` over the pipeline candidates that failed for memory (None if none did)."""
    sized = pipeline_failures(failures)
    return nothing_fits(mesh, sized, sized[0].error.cap, batch) if sized else None


def pipeline_failures(failures: list[tuple[str, Exception]]) -> list[Failure]:
    """The (note, error) pipeline failures that carry a memory breakdown, as Failures."""
    return [Failure(e.mesh, ", ".join(filter(None, [note, e.options])), e) for note, e in failures
            if isinstance(e, StageFitError)]


def smallest_of(err: PlanError, earlier: list[tuple[str, Exception]], mesh, cap: float, batch: int) -> PlanError:
    """``err``, or where it and the ``earlier`` pipeline errors (other recompute choices) came from
    ``nothing_fits``, the same message over all their candidates."""
    sized = [f for e in [err, *(e for _, e in earlier)] for f in getattr(e, "failures", [])]
    return nothing_fits(mesh, sized, cap, batch) if sized else err


class SearchTimeoutError(PlanError):
    """No candidate gave a plan, and some ran out of the solver's time limit (``timed_out``): with a
    larger limit they may. ``timed_out``: their names; ``limit``: the limit they ran under (s)."""

    def __init__(self, message: str, timed_out: list[str], limit: float):
        super().__init__(message)
        self.timed_out, self.limit = timed_out, limit


def no_plan_error(mesh, failures: list[Failure], pipe_failures: list[tuple[str, Exception]], cap: float, batch: int,
                  limit: float) -> PlanError:
    """The error of a search in which no candidate gave a plan. Where none ran out of the solver's time
    limit: ``nothing_fits`` over the failures (or, with only pipeline candidates, their reasons). Else a
    SearchTimeoutError naming the candidates that timed out and the limit to raise, then that verdict
    over the others (none when every candidate timed out)."""
    timed = [f for f in failures if isinstance(f.error, SolverTimeoutError)]
    timed_pipes = [(n, e) for n, e in pipe_failures if isinstance(e, SolverTimeoutError)]
    others = [f for f in failures if f not in timed]
    other_pipes = [(n, e) for n, e in pipe_failures if not isinstance(e, SolverTimeoutError)]
    if others:
        err = nothing_fits(mesh, others + pipeline_failures(other_pipes), cap, batch)
    else:
        reasons = list(dict.fromkeys(f"{n}: {e}" for n, e in other_pipes))   # once per ZeRO stage tried: once
        err = PlanError("no pipeline plan fits: " + "; ".join(reasons[:4]))
    if not timed and not timed_pipes:
        return err
    names = list(dict.fromkeys(
        ["mesh " + " × ".join(f"{a}={s}" for a, s in zip(f.mesh.axis_names, f.mesh.shape)) + (f" ({f.note})" if f.note
                                                                                              else "") for f in timed]
        + [n for n, _ in timed_pipes]))
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    msg = (f"no candidate gave a plan: the solve of {len(names)} candidate(s) ({shown}) found no assignment within the "
           f"solver's time limit of {limit:g} s; raise it (autopar.set_auto_parallel_context(solver_time_limit="
           f"{4 * limit:g})) and they may fit")
    if others or other_pipes:
        msg += f". The other {len(others) + len(other_pipes)} candidate(s): {err}"
    return SearchTimeoutError(msg, names, limit)


STATE = ("parameters", "gradients", "optimizer state", "gathered parameters")


def nothing_fits(mesh, failures: list[Failure], cap: float, batch: int) -> PlanError:
    """The PlanError for a search in which no candidate fits ``cap`` bytes per device."""
    sized = [f for f in failures if f.breakdown]
    if not sized and isinstance(failures[0].error, PlanError):      # not memory: no layout can be made at all
        k = _k(failures[0].note)
        rows = ""
        if k > 1 and isinstance(failures[0].error, CandidateError):
            rows = (f" (accumulation {k} runs the global batch of {batch} as {k} microbatches of {batch // k}; a "
                    "smaller accumulation keeps more rows in each)")
        return PlanError(f"no plan can be made on {mesh}: {failures[0]}{rows}")
    if not sized:
        return PlanError(f"no plan fits memory on {mesh}: {failures[0]}")
    best = min(sized, key=lambda f: sum(f.breakdown.values()))
    parts = best.breakdown
    total = sum(parts.values())
    shown = ", ".join(f"{k} {human_bytes(v)}" for k, v in parts.items() if v)
    options = best.note or "no memory options"
    msg = (f"no plan fits memory on {mesh}: the smallest candidate (mesh {best.mesh.shape}, {options}) needs "
           f"{human_bytes(total)} per device ({shown}) but the cap is {human_bytes(cap)}. ")
    err = PlanError(msg + _more_devices(mesh.size, sized, cap, batch))
    err.failures = sized        # the candidates it weighed (``smallest_of`` joins several searches')
    return err


def _more_devices(n: int, sized: list[Failure], cap: float, batch: int) -> str:
    """N' = n · 2^j, the least j with  S · n / N' + 1.1 a + i <= cap:  S the least state (STATE) of
    any candidate, ``a`` the least activations + transient of one row per device (a candidate's,
    scaled from its microbatch of B / (k · n) rows by s = k · n / B as if every device split the
    batch: the activations by s, the transient by max(s, 1), since the parameter gradients in it
    do not shrink with the rows; 10 % more for the other layouts a larger mesh takes), ``i`` the
    step's inputs (the global batch on every device)."""
    state = min(sum(f.breakdown.get(key, 0.0) for key in STATE) for f in sized)
    inputs = min(f.breakdown.get("inputs", 0.0) for f in sized)

    def one_row(f: Failure) -> float:
        s = _k(f.note) * n / batch
        fixed = ("transient", "accumulated gradients")
        rest = sum(v for key, v in f.breakdown.items() if key not in STATE and key not in ("inputs", *fixed))
        return rest * s + sum(f.breakdown.get(key, 0.0) for key in fixed) * max(s, 1.0)
    row = 1.1 * min(one_row(f) for f in sized) + inputs
    if row >= cap:
        return (f"One row of the batch per device already needs {human_bytes(row)} of activations: split the layers "
                "with tensor or pipeline parallelism, recompute activations, or use devices with more memory.")
    j = max(1, math.ceil(math.log2(state / (cap - row)))) if state else 1    # n itself did not fit
    devices = n * 2**j
    if devices > max(n, batch):
        return (f"Splitting over more devices runs out of batch rows ({batch}) before it fits: add tensor or "
                "pipeline parallelism, a larger batch, or devices with more memory.")
    return (f"About {devices} devices would fit (estimate: the training state split {devices} ways by ZeRO-3 or "
            f"tensor parallelism, a microbatch of one row per device); or use devices with more memory.")


def _k(note: str) -> int:
    """The accumulation a failure's note names (1 if none)."""
    for part in note.split(", "):
        if part.startswith("accumulation "):
            return int(part.split()[1])
    return 1
