"""The collectives a recomputed region runs again in backward, priced where the runtime runs them.

The lowering (``passes/recompute.py``) checkpoints a region as one call: the collectives the passes
inserted between the region's nodes (a tensor-parallel layer's all-gathers and reduce-scatters, the
all-to-alls of a resharded value, an op's own local implementation) are part of it, so when backward
needs the region's saved tensors its forward runs again, collectives included (``COUNTER`` records
them with phase "recompute"). The cost model charges them the same way:

* an edge whose producer and consumer lie in one recomputed region pays its forward redistribution
  once more (``with_recomputed_redistributions``: the ILP's edge time; ``recompute_entries``: the
  plan's list, phase "recompute");
* a recomputed node's local implementation pays its forward collectives once more
  (``strategy_prices.node_costs``; context-parallel attention prices its own, ``solver/cp_costs.py``).

Like the recomputed compute (``cost_models/recompute.py``), this is an upper bound by the region's
tail: non-reentrant checkpointing stops after the last op whose saved tensors backward needs, so a
collective after it (a layer's last reduce-scatter) may not run again. Backward collectives (the
conjugates, Megatron's f) run once, as without recomputation.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from autopar.graph.recompute_regions import choices_for, find_regions
from autopar.solver.spec_rows import spec_row
from autopar.solver.strategy_prices import redistribution_time, tensor_bytes

RECOMPUTE_PHASE = "recompute"


def region_of(gm, recompute) -> dict[str, int]:
    """Node name -> index of the recomputed region holding it (empty: nothing is recomputed)."""
    if recompute in (None, "none"):
        return {}
    regions = find_regions(gm, choices_for(gm, recompute))
    return {n: i for i, r in enumerate(regions) for n in r.nodes}


def same_region(region: dict[str, int], a: str, b: str) -> bool:
    """Whether nodes ``a`` and ``b`` run in one recomputed region (a redistribution between them re-runs)."""
    r = region.get(a)
    return r is not None and r == region.get(b)


def _forward_table(c, s_specs, d_specs, nbytes: float) -> np.ndarray | None:
    """[producer choice, consumer choice] -> forward seconds of the redistribution (None: all zero)."""
    key = ("recompute fwd", s_specs, tuple(d_specs), nbytes)
    if key not in c._tables:
        table = np.array([[0.0 if d is None else redistribution_time(s, d, nbytes, c, grad=False) for d in d_specs]
                          for s in s_specs])
        c._tables[key] = table if table.any() else None
    return c._tables[key]


def with_recomputed_redistributions(edges: list, graph_edges, cands, c, region: dict[str, int]) -> list:
    """``edges`` (in ``graph_edges``' order: ``problem.graph_edges``) with the forward redistribution
    added once more to the time of each edge inside one recomputed region (module docstring)."""
    if not region:
        return edges
    out = list(edges)
    for pos, (n, _node, i, _a, src, idx) in enumerate(graph_edges):
        if not same_region(region, src.name, n):
            continue
        table = _forward_table(c, spec_row(c, cands, src.name, "out", idx), spec_row(c, cands, n, "in", i),
                               tensor_bytes(src, idx))
        if table is not None:
            out[pos] = dataclasses.replace(out[pos], cost=out[pos].cost + table)
    return out


__all__ = ["RECOMPUTE_PHASE", "region_of", "same_region", "with_recomputed_redistributions"]
