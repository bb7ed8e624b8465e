"""The order AUTO tries its candidates in (``solver/candidate_order.py``): a clustered mesh's (dp, tp)
factorisations in-node tensor parallelism first, pipelines by the flat mesh of their tensor-parallel
degree; the order changes no candidate set."""
from __future__ import annotations

import autopar
from autopar.core.context import ParallelMode
from autopar.frontend.trace import trace
from autopar.solver.candidate_order import by_flat_steps, flat_steps, node_order
from autopar.solver.intra_op import DominatedError, InfeasibleError
from autopar.solver.pipeline_search import pipeline_candidates
from autopar.solver.search import candidate_meshes
from examples import factories


def _two_d(meshes):
    return [m.shape for m in meshes if m.axis_names == ("dp", "tp")]


def test_a_clustered_mesh_solves_in_node_tensor_parallelism_first():
    got = _two_d(candidate_meshes(autopar.Mesh(64, device="h100", gpus_per_node=8)))
    assert got == [(8, 8), (16, 4), (32, 2), (4, 16), (2, 32)]
    assert sorted(got) == sorted(_two_d(candidate_meshes(autopar.Mesh(64))))   # the same set
    assert _two_d(candidate_meshes(autopar.Mesh(64))) == [(2, 32), (4, 16), (8, 8), (16, 4), (32, 2)]   # no nodes
    assert node_order(3, 8) == (True, 3) and node_order(4, 8) == (False, -4)




def test_flat_steps_keep_the_fastest_per_degree_and_a_dropped_mesh_at_its_bound():
    from autopar.plan.plan import Plan

    def plan(step):
        p = Plan.__new__(Plan)
        p.step_time = step
        return p
    outcomes = {((8, 8), ("dp", "tp")): plan(0.60), ((16, 4), ("dp", "tp")): plan(0.59),
                ((32, 2), ("dp", "tp")): DominatedError(0.68, 0.59, True),
                ((4, 16), ("dp", "tp")): InfeasibleError("no fit"),
                ((64,), ("d0",)): plan(0.96), ((16, 4), ("cp", "tp")): plan(0.1)}
    got = flat_steps(outcomes, lambda p: p.step_time)
    assert got == {8: 0.60, 4: 0.59, 2: 0.68, 1: 0.96}      # cp meshes and failures without a bound left out


def test_pipelines_come_by_their_flat_mesh_and_all_of_them():
    model, inputs, loss, target = factories.gpt(hidden=64, layers=4, heads=4, seq=32, batch=16, vocab=512)
    traced = trace(model, inputs, loss, target)
    cands, _ = pipeline_candidates(traced, autopar.Mesh(16, gpus_per_node=4), ParallelMode.AUTO, {})
    ordered = by_flat_steps(cands, {2: 0.5, 4: 0.7, 1: 0.9})
    tps = [dict(zip(c.sub.axis_names, c.sub.shape)).get("tp", 1) for c in ordered]
    rank = {2: 0, 4: 1, 1: 2}
    assert [rank.get(t, 3) for t in tps] == sorted(rank.get(t, 3) for t in tps)
    assert sorted(map(id, ordered)) == sorted(map(id, cands))
    same_tp = [c.pp for c in ordered if tps[ordered.index(c)] == 4]
    assert same_tp == [c.pp for c in cands if dict(zip(c.sub.axis_names, c.sub.shape)).get("tp", 1) == 4]  # stable
    assert by_flat_steps(cands, {}) == cands and by_flat_steps(cands, None) == cands


def test_pipeline_cp_shapes_split_the_sequence_where_the_rows_run_out():
    """``cp_candidates.pipeline_cp_shapes``: per tp, the most dp that leaves every stage pp microbatches
    of one row, the rest on cp, only where merging cp into dp could not run pp microbatches."""
    from autopar.solver.cp_candidates import pipeline_cp_shapes

    model, inputs, loss, target = factories.gpt(hidden=64, layers=4, heads=4, seq=64, batch=4, vocab=512)
    traced = trace(model, inputs, loss, target)
    anywhere = lambda tp: True  # noqa: E731
    assert pipeline_cp_shapes(traced, 8, 2, anywhere) == [(2, 4, 1), (2, 2, 2)]    # tp 4: dp x cp = 2 rows: merged
    assert pipeline_cp_shapes(traced, 4, 4, anywhere) == [(1, 4, 1), (1, 2, 2)]
    assert pipeline_cp_shapes(traced, 8, 2, lambda tp: tp == 1) == [(2, 4, 1)]
    assert pipeline_cp_shapes(traced, 2, 8, anywhere) == []     # 4 rows cannot give 8 stages 8 microbatches
    odd = factories.gpt(hidden=64, layers=4, heads=4, seq=63, batch=4, vocab=512)
    assert pipeline_cp_shapes(trace(*odd), 8, 2, anywhere) == []     # 63 tokens split over no cp


def test_auto_pipeline_candidates_include_the_cp_sub_meshes():
    model, inputs, loss, target = factories.gpt(hidden=64, layers=4, heads=4, seq=64, batch=4, vocab=512)
    traced = trace(model, inputs, loss, target)
    cands, _ = pipeline_candidates(traced, autopar.Mesh(16), ParallelMode.AUTO, {})
    cp = [(c.pp, c.sub.shape, c.sub.axis_names) for c in cands if "cp" in c.sub.axis_names]
    assert (2, (2, 4), ("dp", "cp")) in cp and (2, (2, 2, 2), ("dp", "cp", "tp")) in cp and (4, (4,), ("cp",)) in cp
    assert all(c.full.axis_names[0] == "pp" and c.full.size == 16 for c in cands)


def test_on_a_mesh_with_nodes_cp_pipelines_come_only_at_the_widest_in_node_tp():
    """Megatron's order: tp fills a node first, cp goes across nodes."""
    model, inputs, loss, target = factories.gpt(hidden=64, layers=4, heads=4, seq=64, batch=4, vocab=512)
    traced = trace(model, inputs, loss, target)
    cands, _ = pipeline_candidates(traced, autopar.Mesh(32, gpus_per_node=4), ParallelMode.AUTO, {})
    cp = [c for c in cands if "cp" in c.sub.axis_names]
    assert cp and all(dict(zip(c.sub.axis_names, c.sub.shape))["tp"] == 4 for c in cp)
    assert (2, (2, 2, 4)) in [(c.pp, c.sub.shape) for c in cp]
