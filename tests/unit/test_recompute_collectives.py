"""Pipeline unit times as the runtime runs them: a recomputed region's forward collectives run again
in backward (``solver/recompute_collectives.py``), the recomputation itself runs in backward, and an
op's own local implementation (context-parallel attention's gathers, a ring's hops) is counted once."""
from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar import Shard
from autopar.cost_models.devices import mesh_device
from autopar.frontend.trace import trace
from autopar.graph.cut_points import assign_units
from autopar.solver.pipeline_search import unit_profiles
from autopar.solver.recompute_collectives import RECOMPUTE_PHASE
from autopar.solver.search import PlanOptions
from cp_models import TinyGPT, token_loss, tokens

X, Y = tokens(2)


def _plan(mesh, recompute="none", tp=False, layers=2):
    autopar.clear_annotations()
    autopar.reset_auto_parallel_context()
    autopar.set_auto_parallel_context(recompute=recompute, accumulation=1, zero=0)
    if tp:      # Megatron's layout on the tp axis, the norms sequence-parallel
        autopar.shard("blocks.*.qkv", weight={"tp": Shard(0, 3)}, bias={"tp": Shard(0, 3)})
        autopar.shard("blocks.*.fc1", weight={"tp": Shard(0)}, bias={"tp": Shard(0)})
        autopar.shard("blocks.*.proj", weight={"tp": Shard(1)})
        autopar.shard("blocks.*.fc2", weight={"tp": Shard(1)})
        autopar.op_strategy("blocks.*.ln*", tp="S1")
    try:
        return autopar.plan(TinyGPT(layers=layers), mesh, example_inputs=(X,), loss_fn=token_loss, example_target=Y,
                            mode="semi_auto")
    finally:
        autopar.clear_annotations()
        autopar.reset_auto_parallel_context()


def _profiles(plan, mesh, layers=2):
    traced = trace(TinyGPT(layers=layers), (X,), token_loss, Y)
    units, unit_of = assign_units(traced.gm)
    return unit_profiles(traced, plan, units, unit_of, mesh_device(mesh), PlanOptions()).profiles, unit_of


def test_recomputed_layers_pay_their_collectives_again_in_backward():
    mesh = autopar.Mesh(2, axis_names=("tp",), device="h100")
    none, full = _plan(mesh, "none", tp=True), _plan(mesh, "full", tp=True)
    again = [c for c in full.collective_list if c.phase == RECOMPUTE_PHASE]
    forward = {(c.kind, c.bytes, c.node) for c in full.collective_list if c.phase == "fwd"}
    assert again and all(c.axes == ["tp"] and (c.kind, c.bytes, c.node) in forward for c in again)
    assert all(full.nodes[c.node].module.startswith("blocks.") for c in again)
    assert not any(c.phase == RECOMPUTE_PHASE for c in none.collective_list)
    p_full, unit_of = _profiles(full, mesh)
    without = dataclasses.replace(full, collective_list=[c for c in full.collective_list if c.phase != RECOMPUTE_PHASE])
    p_without, _ = _profiles(without, mesh)
    for u, (a, b) in enumerate(zip(p_full, p_without)):
        listed = sum(c.time for c in again if unit_of.get(c.node) == u)
        assert a.fwd == pytest.approx(b.fwd, rel=1e-9)                 # the re-run collectives are backward's
        assert a.bwd - b.bwd == pytest.approx(listed, rel=1e-9)
    # the recomputation runs in backward: of two middle blocks laid out alike, the recomputed one has
    # the same forward and a backward longer by the forward again and its listed collectives
    mixed = _plan(mesh, {"blocks.1": "full"}, tp=True, layers=4)
    p_mixed, unit_of = _profiles(mixed, mesh, layers=4)
    one, two = ([d.strategy for d in mixed.nodes.values() if d.module.startswith(f"blocks.{i}.")] for i in (1, 2))
    assert one == two
    listed = sum(c.time for c in mixed.collective_list if c.phase == RECOMPUTE_PHASE)
    assert listed > 0 and {unit_of[c.node] for c in mixed.collective_list if c.phase == RECOMPUTE_PHASE} == {1}
    assert p_mixed[1].fwd == pytest.approx(p_mixed[2].fwd, rel=1e-6)
    assert p_mixed[1].bwd > p_mixed[2].bwd + listed


def test_local_implementation_collectives_count_once_in_unit_times():
    """Context-parallel attention's K/V gathers are in the node's time (its cp cost); the plan lists
    them too, marked ``in_node``: a unit's time must not add them a second time."""
    mesh = autopar.Mesh(4, axis_names=("cp",), device="h100")
    plan = _plan(mesh)
    own = [c for c in plan.collective_list if c.in_node]
    assert any("attention" in c.node for c in own)      # the K/V gathers (and the loss's own all-reduce)
    profiles, _ = _profiles(plan, mesh)
    units = sum(p.fwd + p.bwd for p in profiles)
    nodes = sum(d.time for d in plan.nodes.values())
    edges = sum(c.time for c in plan.collective_list if not c.in_node and c.phase in ("fwd", "bwd")
                and c.node in plan.nodes)
    assert units <= nodes + edges + 1e-12
    assert sum(c.time for c in own) > 0.1 * units      # large enough that counting them twice would show


def _with_form(plan, form: str):
    out = autopar.Plan.from_json(plan.to_json())
    for d in out.nodes.values():
        if "scaled_dot_product_attention" in d.op:
            d.local = [form if loc and loc.endswith(":cp") else loc for loc in d.local]
    return out


@pytest.mark.parametrize("recompute", ["none", "except_attention", "full"])
def test_a_stage_holds_the_gather_forms_gathered_kv_unless_attention_is_recomputed(recompute):
    """The gather form saves the whole sequence's K/V for backward (``cp_costs.cp_saved_bytes``: 3 more
    shards on cp 4), the ring only its own: a pipeline unit's activations differ by exactly that where
    the attention runs once ("none", "except_attention"), and not at all where it is recomputed."""
    mesh = autopar.Mesh(4, axis_names=("cp",), device="h100")
    plan = _plan(mesh, recompute)
    gather, _ = _profiles(_with_form(plan, "attn_gather:cp"), mesh)
    ring, unit_of = _profiles(_with_form(plan, "attn_ring:cp"), mesh)
    # K and V of one layer: batch 2 x 4 heads x 64 / 4 positions x head dim 8, fp32, each; 3 more shards each
    kv = 2 * (2 * 4 * 16 * 8 * 4)
    extra = 0 if recompute == "full" else 3 * kv
    attention = {unit_of[n] for n, d in plan.nodes.items() if "scaled_dot_product_attention" in d.op}
    assert len(attention) == 2
    for u, (g, r) in enumerate(zip(gather, ring)):
        assert g.activation_bytes - r.activation_bytes == pytest.approx(extra if u in attention else 0.0)
