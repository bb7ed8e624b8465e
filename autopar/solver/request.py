"""One planning request as the search's inner functions receive it, the way torchtitan hands
``ParallelDims`` around: the traced step, the model, the mesh, the mode, the options, the user's
annotations and the retracer travel together instead of as eight arguments. ``search.make_plans``
builds it; a candidate's request is the same with other options or another traced microbatch
(``replace``, ``with_options``). ``PlanOptions`` lives here beside it (``mesh_solve`` re-exports it)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autopar.core.context import ParallelMode
from autopar.core.mesh import Mesh
from autopar.cost_models.moe import DEFAULT_IMBALANCE
from autopar.solver.progress import SearchProgress

if TYPE_CHECKING:
    from autopar.graph.retrace import Retracer


@dataclass
class PlanOptions:
    """The planning options of a request (the context's, ``api._options``); ``mesh_solve`` re-exports it."""
    optimizer: str = "adamw"
    precision: str = "fp32"          # what the training state is costed in ("mixed": fp32 master + bf16 copy)
    grad_compression: str | None = None
    mixed_precision: str | None = None
    memory_budget_gb: float | None = None
    time_limit_s: float = 10.0
    microbatches: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None  # model stages per pipeline rank, interleaved (None: the planner picks)
    accumulation: int | None = None  # microbatches run one after another (None: AUTO/SEMI_AUTO pick when needed)
    recompute: str | dict | None = None   # activation recomputation (None: AUTO/SEMI_AUTO pick when needed)
    recompute_layers: int | None = None   # "full" on this many layers only (graph/recompute_layers.py)
    zero: int | None = None          # ZeRO stage over the data-parallel axes (None: AUTO/SEMI_AUTO pick when needed)
    compiled: bool = False           # per-rank programs through torch.compile: compute at the compiled speedup
    moe_imbalance: float = DEFAULT_IMBALANCE   # MoE expert load of the busiest rank over the mean (cost_models/moe.py)
    progress: SearchProgress | None = None     # reports the search and holds its time budget (solver/progress.py)


@dataclass(frozen=True)
class SolveRequest:
    traced: Any                     # frontend.trace's traced step (or one microbatch of it)
    model: Any                      # the user's module: its stage tags (``annotations.resolve_stages``)
    mesh: Mesh
    mode: ParallelMode
    opts: PlanOptions
    param_ann: dict = field(default_factory=dict)   # parameter name -> {axis: placement} (``autopar.shard``)
    input_ann: dict = field(default_factory=dict)   # input name -> {axis: placement}
    retracer: Retracer | None = None                # re-traces the step at a microbatch shape (pipelines)

    def replace(self, **changes) -> SolveRequest:
        return dataclasses.replace(self, **changes)

    def with_options(self, **changes) -> SolveRequest:
        """The request with these fields of ``opts`` changed."""
        return dataclasses.replace(self, opts=dataclasses.replace(self.opts, **changes))
