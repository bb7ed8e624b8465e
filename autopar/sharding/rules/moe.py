"""``autopar::moe_experts`` (``frontend/moe_experts.py``; inputs hidden [T, H], top_k_index [T, k],
top_k_weights [T, k], then every expert parameter, expert dim first), per mesh axis:

* ``batch``: tokens split, experts replicated (data parallelism) -> S0;
* ``ep``: tokens and experts split; rows travel to their expert's rank by all_to_all -> S0;
* ``experts``: tokens whole, experts split; each rank adds its experts' rows -> Partial.

Each names the local implementation ``moe:<role>`` (``collectives/moe_dispatch.py``), which the
per-rank program always runs, on every strategy (``passes/insert_collectives.py``).
"""
from __future__ import annotations

import torch

import autopar.frontend.moe_experts  # noqa: F401 - defines the op
from autopar.sharding.placements import P, R, Shard
from autopar.sharding.registry import register_rule
from autopar.sharding.strategy import AxisStrategy, tensor_inputs

S0 = Shard(0)


@register_rule(torch.ops.autopar.moe_experts.default)
def moe_experts(node):
    n_params = len(tensor_inputs(node)) - 3
    return [
        AxisStrategy((S0, S0, S0) + (R,) * n_params, S0, "moe:batch", "batch"),
        AxisStrategy((S0, S0, S0) + (S0,) * n_params, S0, "moe:ep", "ep"),
        AxisStrategy((R, R, R) + (S0,) * n_params, P, "moe:experts", "experts"),
    ]
