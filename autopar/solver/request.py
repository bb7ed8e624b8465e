"""One planning request as the search's inner functions receive it, the way torchtitan hands
``ParallelDims`` around: the traced step, the model, the mesh, the mode, the options, the user's
annotations and the retracer travel together instead of as eight arguments. ``search.make_plans``
builds it; a candidate's request is the same with other options or another traced microbatch
(``replace``, ``with_options``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autopar.core.context import ParallelMode
from autopar.core.mesh import Mesh

if TYPE_CHECKING:
    from autopar.graph.retrace import Retracer
    from autopar.solver.mesh_solve import PlanOptions


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
