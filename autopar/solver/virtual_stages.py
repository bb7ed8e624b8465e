"""Virtual pipeline stages (v model stages per pipeline rank, "interleaved_1f1b") as a planned
choice: which v the stage-cut DP tries, and the best partition over them.

Megatron-LM sets v by hand (``--virtual-pipeline-model-parallel-size``), torchtitan by layers per
stage; here ``set_auto_parallel_context(virtual_stages=v)`` fixes it and otherwise the search
tries (``virtual_stage_choices``)

    v = 2, 4, 8, ...   while pp * v <= number of cut units,
                       stopping after the first v whose ideal bubble (pp - 1) / (v m) < MIN_BUBBLE.

Why this rule: the interleaved bubble is about (pp - 1) / (v m) of the step (Narayanan et al.,
SC'21), so doubling v saves at most half of it while every cut adds a p2p hop per microbatch and
the ranks hold more stages; once the bubble is under MIN_BUBBLE the next doubling can gain at most
MIN_BUBBLE / 2 of the step, under what the cost model resolves. Powers of two keep the candidates
few (three for Mixtral's pp 4 x 16 microbatches: 2, 4, 8); the DP cuts uneven layer counts, so v
need not divide them. Each v is cut and simulated in full (``best_over_virtual_stages``): the
hops, the in-flight memory (``interleaved_memory``) and the simulated bubble decide, not the rule.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from autopar.solver.inter_op import PipelinePartition, StageMemoryError

INTERLEAVED = "interleaved_1f1b"
MIN_BUBBLE = 0.01


class VirtualStagesError(ValueError):
    """A ``virtual_stages`` request the pipeline cannot take."""


def check_virtual_stages(v: int | None, schedule: str | None, pp: int, num_units: int,
                         layers: int | None = None) -> None:
    """A fixed ``virtual_stages`` needs the interleaved schedule and pp x v cut units (``num_units``:
    the ``layers`` and the end units, ``graph.cut_points``)."""
    if v is None:
        return
    if schedule is not None and schedule != INTERLEAVED:
        raise VirtualStagesError(
            f"virtual_stages={v} needs the {INTERLEAVED!r} schedule, but schedule={schedule!r} runs one model stage "
            f"per pipeline rank; set schedule='{INTERLEAVED}' (or None), or virtual_stages=None")
    if pp * v > num_units:
        raise VirtualStagesError(
            f"virtual_stages={v} on {pp} pipeline ranks needs {pp * v} model stages, but the traced model has only "
            f"{num_units} layers to cut between{_ends(num_units, layers)} (every stage needs one); use "
            f"virtual_stages <= {max(num_units // pp, 1)}"
            " or fewer pipeline stages")


def _ends(num_units: int, layers: int | None) -> str:
    if layers is None or layers == num_units:
        return ""
    return f" ({layers} repeated layers and {num_units - layers} end unit(s): the embedding, the head)"


def virtual_stage_choices(pp: int, m: int, num_units: int, fixed: int | None = None) -> list[int]:
    """The v values to cut at (module docstring); ``fixed``: the user's."""
    if fixed is not None:
        return [fixed]
    out, v = [], 2
    while pp * v <= num_units:
        out.append(v)
        if (pp - 1) / (v * m) < MIN_BUBBLE:
            break
        v *= 2
    return out or [2]


def best_over_virtual_stages(cut: Callable[[int], tuple[PipelinePartition, float, float]],
                             choices: Sequence[int]) -> tuple[PipelinePartition, float, float]:
    """The (partition, step, optimizer seconds) of ``cut(v)`` with the least step over ``choices``
    (ties: the smaller v). When no v fits, the error of the v that came closest: the least peak a
    ``StageMemoryError`` names, else the first."""
    best, errors = None, []
    for v in choices:
        try:
            got = cut(v)
        except ValueError as err:
            errors.append(err)
            continue
        if best is None or got[1] < best[1] * (1 - 1e-12):
            best = got
    if best is not None:
        return best
    memory = [e for e in errors if isinstance(e, StageMemoryError)]
    raise min(memory, key=lambda e: e.state + e.activations) if memory else errors[0]
