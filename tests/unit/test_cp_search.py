"""AUTO considers context parallelism (issue 35 part 4): an unnamed mesh gets candidates with a
"cp" axis where the model has attention whose sequence the cp size divides
(``solver/cp_candidates.py``), and AUTO picks them only where they win."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import autopar
from autopar import Shard
from autopar.frontend.trace import trace
from autopar.solver import search
from autopar.solver.search import candidate_meshes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cp_models import TinyGPT, token_loss, tokens  # noqa: E402



_SOLVE = search.solve_on_mesh


def _shapes(meshes) -> set:
    return {(m.shape, m.axis_names) for m in meshes}


def test_candidates_with_a_cp_axis_only_where_attention_splits():
    x, y = tokens(2, seq=64)
    traced = trace(TinyGPT(layers=1), (x,), token_loss, y)
    got = _shapes(candidate_meshes(autopar.Mesh(8), traced=traced))
    cp = {s for s in got if "cp" in s[1]}
    # (dp, cp, tp), cp >= 2, dp dividing the batch of 2
    assert cp == {((8,), ("cp",)), ((2, 4), ("cp", "tp")), ((4, 2), ("cp", "tp")), ((2, 4), ("dp", "cp")),
                  ((2, 2, 2), ("dp", "cp", "tp"))}, got
    assert got - cp == _shapes(candidate_meshes(autopar.Mesh(8)))     # the others as without attention
    # a sequence of 6 splits over 2 (and 3), not 4 or 8: no cp axis of 4 or 8
    x6, y6 = torch.randint(1, 64, (4, 6)), torch.randint(0, 64, (4, 6))
    traced6 = trace(TinyGPT(layers=1, seq=6), (x6,), token_loss, y6)
    sizes = {m.shape[m.axis_names.index("cp")] for m in candidate_meshes(autopar.Mesh(8), traced=traced6)
             if "cp" in m.axis_names}
    assert sizes == {2}
    # no attention: no cp candidate
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    traced_mlp = trace(mlp, (torch.randn(8, 8),), nn.functional.mse_loss, torch.randn(8, 8))
    assert not any("cp" in m.axis_names for m in candidate_meshes(autopar.Mesh(8), traced=traced_mlp))


def test_batch_of_one_has_no_dp_cp_candidate():
    x, y = tokens(1, seq=64)
    traced = trace(TinyGPT(layers=1), (x,), token_loss, y)
    cp = {s for s in _shapes(candidate_meshes(autopar.Mesh(4), traced=traced)) if "cp" in s[1]}
    assert cp == {((4,), ("cp",)), ((2, 2), ("cp", "tp"))}


def _long_row(cap_gb: float, **levers):
    """Batch 1 (no dp), one attention head (no heads split), a sequence of 512 on Mesh(4) under a
    cap the whole sequence on a rank does not meet."""
    x, y = tokens(1, seq=512)
    autopar.set_auto_parallel_context(memory_budget_gb=cap_gb, **levers)
    return autopar.plan(TinyGPT(layers=1, seq=512, heads=1), autopar.Mesh(4), example_inputs=(x,),
                        loss_fn=token_loss, example_target=y)


def test_auto_picks_cp_for_a_long_sequence_of_one_row_under_a_memory_cap():
    """AUTO's plan splits the sequence (cp 4) and fits; its report names the cp axis and the
    attention form. (Recomputation and ZeRO fixed off to keep this fast: the mesh is the question.)"""
    plan = _long_row(0.0011, recompute="none", zero=0)
    assert plan.degrees["cp"] > 1, plan.report()
    assert max(plan.memory_per_device) <= 0.0011 * 2**30
    text = plan.report()
    assert "cp=" in text and "context parallelism" in text
    assert "all-gather K/V" in text or "ring" in text
    assert any("cp" in a.note or "d0" in a.note for a in plan.alternatives)


@pytest.mark.slow
def test_auto_picks_cp_under_a_memory_cap_with_every_lever_free():
    plan = _long_row(0.0011)
    assert plan.degrees["cp"] > 1 and max(plan.memory_per_device) <= 0.0011 * 2**30, plan.report()


@pytest.mark.slow
def test_auto_keeps_cp_1_for_a_short_sequence_and_a_large_batch():
    x, y = tokens(8, seq=64)
    plan = autopar.plan(TinyGPT(), autopar.Mesh(4), example_inputs=(x,), loss_fn=token_loss, example_target=y)
    assert plan.degrees["cp"] == 1 and plan.degrees["dp"] >= 2, plan.report()
    assert any("cp" in a.note for a in plan.alternatives)       # the cp candidates were tried, and lost


@pytest.mark.slow
def test_annotated_cp_on_an_unnamed_mesh_gets_a_cp_candidate():
    """AUTO on an unnamed mesh with ``shard_input(0, {"cp": Shard(1)})``: the candidates with a cp
    axis; SEMI_AUTO takes the mesh as given, whose error names the axis."""
    x, y = tokens(2, seq=64)
    autopar.shard_input(0, {"cp": Shard(1)})
    plan = autopar.plan(TinyGPT(), autopar.Mesh(4), example_inputs=(x,), loss_fn=token_loss, example_target=y)
    assert "cp" in plan.mesh.axis_names and plan.degrees["cp"] > 1
    assert "Z(1)" in str(plan.inputs[next(iter(plan.inputs))])     # causal: the sequence in the zig-zag order
    with pytest.raises(autopar.PlanError, match="unknown mesh axis 'cp'"):
        autopar.plan(TinyGPT(), autopar.Mesh(4), example_inputs=(x,), loss_fn=token_loss, example_target=y,
                     mode="semi_auto")


def test_batch_rule_merges_cp_into_the_data_axis_only_where_the_rows_split():
    """``cp_candidates.batch_merged``: a cp mesh whose dp x cp divides the microbatch's rows has the
    merged (dp · cp, tp) mesh (the 1-D mesh when tp = 1); fewer rows than dp x cp keep the cp mesh."""
    from autopar.solver.cp_candidates import batch_merged
    x, y = tokens(2, seq=64)
    traced = trace(TinyGPT(layers=1), (x,), token_loss, y)
    merged = {s: batch_merged(traced, m) for m in candidate_meshes(autopar.Mesh(8), traced=traced)
              if "cp" in (s := (m.shape, m.axis_names))[1]}
    shapes = {s: (m.shape, m.axis_names) if m is not None else None for s, m in merged.items()}
    assert shapes == {((8,), ("cp",)): None,                          # 8 > 2 rows: only cp splits further
                      ((2, 4), ("cp", "tp")): ((2, 4), ("dp", "tp")),
                      ((4, 2), ("cp", "tp")): None,
                      ((2, 4), ("dp", "cp")): None,
                      ((2, 2, 2), ("dp", "cp", "tp")): None}, shapes
    x8, y8 = tokens(8, seq=64)
    traced8 = trace(TinyGPT(layers=1), (x8,), token_loss, y8)
    got = {(m.shape, m.axis_names): batch_merged(traced8, m) for m in candidate_meshes(autopar.Mesh(8), traced=traced8)
           if "cp" in m.axis_names}
    assert got[((2, 4), ("dp", "cp"))].shape == (8,) and got[((2, 4), ("dp", "cp"))].axis_names == ("d0",)
    assert got[((2, 2, 2), ("dp", "cp", "tp"))].shape == (4, 2)
    assert all(m is not None for m in got.values())


def _solved_meshes(monkeypatch, rule: bool, batch: int, mesh, **kw):
    """The plan of a 2-layer GPT (hidden 256, sequence 256) of ``batch`` rows and the meshes its search
    solved, the batch rule on or off."""
    from autopar.solver import cp_candidates
    monkeypatch.setattr(cp_candidates, "CP_BATCH_RULE", rule)
    solved, solve = [], _SOLVE      # the unwrapped solve (a second call would wrap the first spy)

    def spy(req, *a, **k):
        solved.append((req.mesh.shape, req.mesh.axis_names, req.traced.batch_size))
        return solve(req, *a, **k)
    monkeypatch.setattr(search, "solve_on_mesh", spy)
    from examples import factories
    model, inputs, loss, target = factories.gpt(hidden=256, layers=2, heads=8, seq=256, batch=batch, vocab=1024)
    autopar.set_auto_parallel_context(recompute="none", zero=0, **kw)
    plan = autopar.plan(model, mesh, example_inputs=inputs, loss_fn=loss, example_target=target)
    return plan, solved


def test_batch_rule_skips_the_cp_meshes_a_data_axis_does_at_least_as_well(monkeypatch):
    """8 rows on 4 devices: every cp mesh's dp x cp divides the rows. With the rule none is solved and
    the plan is the one the search without the rule picks (the cp meshes lost there); they are listed."""
    on, solved_on = _solved_meshes(monkeypatch, True, 8, autopar.Mesh(4, device="h100"), accumulation=1)
    off, solved_off = _solved_meshes(monkeypatch, False, 8, autopar.Mesh(4, device="h100"), accumulation=1)
    assert not any("cp" in names for _, names, _ in solved_on), solved_on
    assert any("cp" in names for _, names, _ in solved_off), solved_off         # without the rule they are solved
    assert on.degrees == off.degrees and on.step_time == pytest.approx(off.step_time, rel=1e-9)
    assert any("cp axis merged into the data axis" in a.note for a in on.alternatives)


def test_batch_rule_keeps_cp_where_the_rows_run_out(monkeypatch):
    """One row of a long sequence under a cap only cp meets: every cp mesh has more ranks than rows,
    the rule skips none, and the plan splits the sequence (the option the rule must not lose)."""
    from autopar.solver import cp_candidates
    monkeypatch.setattr(cp_candidates, "CP_BATCH_RULE", True)
    plan = _long_row(0.0011, recompute="none", zero=0)
    assert plan.degrees["cp"] > 1 and max(plan.memory_per_device) <= 0.0011 * 2**30, plan.report()
    assert not any("cp axis merged" in a.note for a in plan.alternatives)


def test_batch_rule_needs_the_merged_mesh_to_have_done_as_well():
    """``search._merged_wins``: a plan of the merged mesh that wastes an axis (a tiny model replicated,
    which AUTO ranks after any plan that splits), a timeout or no solve leave the cp mesh to be solved."""
    from autopar.core.context import ParallelMode
    from autopar.solver.intra_op import DominatedError, InfeasibleError, SolverTimeoutError
    mesh = autopar.Mesh((2, 2), ("dp", "tp"))
    splits = autopar.Plan(mode=ParallelMode.AUTO, mesh=mesh, degrees={}, axis_roles={"dp": "data", "tp": "tensor"})
    wastes = autopar.Plan(mode=ParallelMode.AUTO, mesh=mesh, degrees={}, axis_roles={"dp": "data", "tp": "none"})
    assert search._merged_wins(splits) and search._merged_wins(InfeasibleError("over"))
    assert search._merged_wins(DominatedError(1.0, 0.5, False))
    assert not search._merged_wins(wastes) and not search._merged_wins(SolverTimeoutError("late"))
    assert not search._merged_wins(None)
