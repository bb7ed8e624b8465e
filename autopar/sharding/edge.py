"""Which collectives one use of a value runs: ONE decision for the plan's list
(``solver/decode.py``) and the lowering (``passes/insert_collectives.py``).

A consumer wants ``want`` of a value placed ``have``. Forward: the ``redistribute_steps``.
Backward: each step's conjugate (``comm`` module table), except that

* on an axis where the consumer runs split but uses the value replicated (``f_axes``), the
  value's gradient is a partial sum: the last all-gather on that axis (no later step on it)
  sums it with a reduce-scatter (Megatron-SP, ``fused``); otherwise a ``grad_all_reduce``
  (Megatron's f) sums it (``grad_sum``);
* on axes where a parameter's gradient is summed after backward instead (``partial_axes`` of
  ``grad_sync_rule``), nothing sums it here;
* on ``pgrad`` axes (``grad_sync_rule.exit_axes``) local steps keep partial gradients: a slice
  backward is a zero-padded gradient, not an all-gather; a replicated use there that is not split
  keeps the gradient on rank 0 only (``once``, ``comm.partial_grad``; no collective).
"""
from __future__ import annotations

from dataclasses import dataclass

from autopar.sharding.placements import Replicate
from autopar.sharding.redistribute import backward_kind, redistribute_steps


@dataclass(frozen=True)
class EdgeCollectives:
    steps: tuple
    fused: frozenset        # indices of the all-gather steps whose backward is a reduce-scatter
    grad_sum: tuple         # axes whose gradient a grad_all_reduce sums (sorted)
    once: tuple             # axes of comm.partial_grad (sorted)
    pgrad: frozenset        # axes where local steps keep partial gradients

    def forward(self, j: int) -> str | None:
        """The collective step ``j`` runs forward (None: a local step)."""
        st = self.steps[j]
        return st.kind if st.communicates else None

    def backward(self, j: int) -> str | None:
        """The collective autograd runs for step ``j`` backward (None: none)."""
        st = self.steps[j]
        if j in self.fused:
            return "reduce_scatter"
        if st.axis in self.pgrad and st.kind in ("local_slice", "to_partial"):
            return None
        kind = backward_kind(st.kind)
        return None if kind == "local_slice" else kind


def fused_gathers(steps, f_axes: set[int]) -> set[int]:
    """Indices of the all-gather steps whose backward is a reduce-scatter (Megatron-SP): the last
    gather on an axis of ``f_axes`` with no later step on that axis."""
    out = set()
    for ax in f_axes:
        gathers = [j for j, s in enumerate(steps) if s.kind == "all_gather" and s.axis == ax]
        if gathers and not any(s.axis == ax for s in steps[gathers[-1] + 1:]):
            out.add(gathers[-1])
    return out


def edge_collectives(have, want, split: set[int], partial_axes=(), exit_axes=()) -> EdgeCollectives:
    """The collectives a consumer whose outputs are split on ``split`` runs to use a value placed
    ``have`` as ``want`` (module docstring)."""
    steps = redistribute_steps(have, want)
    f_axes = {a for a in split if isinstance(want[a], Replicate)} - set(partial_axes)
    fused = fused_gathers(steps, f_axes)
    pgrad = frozenset(exit_axes)
    once = {a for a in pgrad if isinstance(want[a], Replicate) and a not in split}
    return EdgeCollectives(tuple(steps), frozenset(fused), tuple(sorted(f_axes - {steps[j].axis for j in fused})),
                           tuple(sorted(once)), pgrad)
