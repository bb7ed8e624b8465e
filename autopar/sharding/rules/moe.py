"""``autopar::moe_experts`` (``frontend/moe_experts.py``; inputs hidden [T, H], top_k_index [T, k],
top_k_weights [T, k], then every expert parameter, expert dim first), per mesh axis:

* ``batch``: tokens split, experts replicated (data parallelism) -> S0;
* ``ep``: tokens and experts split; rows travel to their expert's rank by all_to_all -> S0;
* ``experts``: tokens whole, experts split; each rank adds its experts' rows -> Partial;
* ``etp`` (expert tensor parallelism): tokens whole, every expert's FFN split like a Megatron MLP
  (:func:`etp_placements`) -> Partial. Composes with ``ep`` on another axis (Megatron-Core's
  "parallel folding": ep x etp).

Each names the local implementation ``moe:<role>`` (``collectives/moe_dispatch.py``), which the
per-rank program always runs, on every strategy (``passes/insert_collectives.py``).
"""
from __future__ import annotations

import torch

import autopar.frontend.moe_experts  # noqa: F401 - defines the op
from autopar.frontend.moe_experts import registered
from autopar.sharding.placements import P, R, Shard
from autopar.sharding.registry import register_rule
from autopar.sharding.strategy import AxisStrategy, tensor_inputs

S0 = Shard(0)


def etp_placements(e) -> tuple | None:
    """Per parameter of experts entry ``e`` (``frontend.moe_experts.ExpertsEntry``), its placement
    under expert tensor parallelism, or None where the module's layout is not one autopar knows:

    * ``gate_up_proj`` [E, 2F, H] (``[E, H, 2F]`` when ``is_transposed``) and its bias [E, 2F]:
      column-parallel on the 2F dim; a concatenated [gate; up] is split block-wise
      (``Shard(dim, chunks=2)``: each rank keeps its rows of the gate and of the up half), an
      interleaved one (GPT-OSS: gate = ``[..., ::2]``) contiguously (pairs stay together);
      ``up_proj`` (no gate) likewise with one block;
    * ``down_proj`` [E, H, F] (``[E, F, H]`` transposed): row-parallel on the F dim;
    * ``down_proj_bias`` [E, H]: Partial (added once: ``to_partial`` keeps it on one rank).

    A post-expert norm (``has_post_expert_norm``) or any other parameter rules it out.
    """
    if getattr(e.template, "has_post_expert_norm", False):
        return None
    chunks = 2 if e.has_gate and e.is_concatenated else 1
    col = 2 if e.is_transposed else 1
    out = []
    for name in e.param_names:
        if name in ("gate_up_proj", "up_proj"):
            out.append(Shard(col, chunks if name == "gate_up_proj" else 1))
        elif name in ("gate_up_proj_bias", "up_proj_bias"):
            out.append(Shard(1, chunks if name == "gate_up_proj_bias" else 1))
        elif name == "down_proj":
            out.append(Shard(1 if e.is_transposed else 2))
        elif name == "down_proj_bias":
            out.append(P)
        else:
            return None
    return tuple(out)


@register_rule(torch.ops.autopar.moe_experts.default)
def moe_experts(node):
    n_params = len(tensor_inputs(node)) - 3
    out = [
        AxisStrategy((S0, S0, S0) + (R,) * n_params, S0, "moe:batch", "batch"),
        AxisStrategy((S0, S0, S0) + (S0,) * n_params, S0, "moe:ep", "ep"),
        AxisStrategy((R, R, R) + (S0,) * n_params, P, "moe:experts", "experts"),
    ]
    e = registered(node.args[0])
    etp = etp_placements(e) if e is not None and len(e.param_names) == n_params else None
    if etp is not None:
        out.append(AxisStrategy((R, R, R) + etp, P, "moe:etp", "etp"))
    return out
