"""What a pipeline plan's step runs between stages, added to its intra-op plan's collectives."""
from __future__ import annotations

import math
from dataclasses import replace

from autopar.plan.plan import Collective, Plan
from autopar.plan.specs import PlanSpecs
from autopar.plan.stage_cuts import assign_stages, stage_placeholders, stage_transfers
from autopar.sharding.placements import local_shape


def pipeline_collectives(gm, plan: Plan, link: tuple[float, float]) -> list[Collective]:
    """``plan.collective_list`` (the intra-op plan's, one microbatch) with what pipelining adds,
    from the same stage cuts the runtime splits the graph at (``plan/stage_cuts.py``):

    * per transfer ``t`` between stages on different ranks, per microbatch: forward, a send on
      ``t.src`` and a receive on ``t.dst``; backward (floating values), the gradient back
      (a send on ``t.dst``, a receive on ``t.src``); ``t``'s local bytes each, over the pp axis;
    * per trainable parameter used on stages of several pp ranks (a tied embedding), once per
      step: the all-reduce of its gradient over them (``PipelineModule._sync_grads``);
    * a parameter's per-step gradient sum runs on the stages that use it, the loss report on the
      last stage (``stages``; ``plan.collectives(rank)`` keeps a rank's own).

    ``gm`` is the plan's microbatch graph; every op has a stage, so it is not changed."""
    n = len(plan.stages)
    stage_of = {name: st.index for st in plan.stages for name in st.nodes}
    stages = assign_stages(gm, stage_of, n)
    specs = PlanSpecs(plan, len(plan.mesh.shape))
    pp_axis, per_pp = plan.mesh.axis_names[0], plan.mesh.size // plan.mesh.shape[0]
    bandwidth, latency = link

    def coord(stage: int) -> int:
        return plan.stages[stage].ranks[0] // per_pp

    by_name = {node.name: node for node in gm.graph.nodes}
    uses: dict[str, list[int]] = {}
    for s in range(n):
        for ph in sorted(node.name for node in stage_placeholders(gm, stages, s, s == n - 1)):
            uses.setdefault(ph, []).append(s)
    out = []
    for c in plan.collective_list:
        if c.stages:
            pass
        elif c.node in uses:                    # a parameter's gradient sum: on the stages using it
            c = replace(c, stages=list(uses[c.node]))
        elif not c.node:                        # the loss report: the last stage holds the loss
            c = replace(c, stages=[n - 1])
        out.append(c)
    for t in stage_transfers(gm, stages, n, specs, plan.mesh.shape):
        if coord(t.src) == coord(t.dst):        # one rank holds both (interleaved): handed over in memory
            continue
        node = t.value if t.value in plan.nodes else by_name[t.value].args[0].name   # getitem: its tuple op
        nbytes, time = t.nbytes, latency + t.nbytes / bandwidth
        out += [Collective("send", nbytes, [pp_axis], "fwd", node, time, [t.src]),
                Collective("recv", nbytes, [pp_axis], "fwd", node, time, [t.dst])]
        if t.floating:
            out += [Collective("send", nbytes, [pp_axis], "bwd", node, time, [t.dst]),
                    Collective("recv", nbytes, [pp_axis], "bwd", node, time, [t.src])]
    for name in sorted(plan.params):
        d = plan.params[name]
        on = uses.get(d.placeholder, [])
        k = len({coord(s) for s in on})
        if d.kind != "parameter" or not d.trainable or k < 2:
            continue
        val = by_name[d.placeholder].meta["val"]
        nbytes = math.prod(local_shape(tuple(val.shape), specs.spec(by_name[d.placeholder]), plan.mesh.shape))
        nbytes *= val.element_size()
        time = 2 * (k - 1) * latency + 2 * (k - 1) / k * nbytes / bandwidth
        out.append(Collective("all_reduce", int(nbytes), [pp_axis], "bwd", d.placeholder, time, list(on)))
    return out
