"""A candidate layout that violates a constraint of the job is dropped by AUTO with a one-line
reason in the alternatives, never an exception that ends the search (issue 15, part 4); the same
constraint on the user's own mesh is the error."""
from __future__ import annotations

import re

import pytest
import torch

import autopar
from autopar.plan.plan import CandidateError
from examples.models import GPT, lm_loss


def _job():
    with torch.device("meta"):
        model = GPT(vocab=128, hidden=48, heads=6, layers=2, seq=16)
    x = torch.randint(0, 128, (4, 16))
    return model, x


def test_auto_drops_candidates_the_batch_does_not_divide():
    model, x = _job()
    plan = autopar.plan(model, autopar.Mesh(6, device="h100"), example_inputs=(x,), loss_fn=lm_loss,
                        example_target=x, mode="auto")
    assert 4 % plan.degrees["dp"] == 0, plan.degrees
    dropped = [a.note for a in plan.alternatives if not a.fits]
    assert any(n.startswith("mesh (6,)") and "not divisible by the data-parallel size 6" in n for n in dropped), dropped
    assert any(n.startswith("mesh (3, 2)") and "not divisible by the data-parallel size 3" in n for n in dropped)
    assert any("sub-mesh {'dp': 3}" in n and "no microbatch count splits it evenly" in n for n in dropped), dropped
    assert any("2 layers < 3 stages" in n for n in dropped), dropped


def test_the_users_own_mesh_that_the_batch_does_not_divide_is_the_error():
    model, x = _job()
    with pytest.raises(CandidateError, match=r"global batch \(4.*not divisible by the data-parallel size 3.*multiple of 3"):
        autopar.plan(model, autopar.Mesh((3, 2), axis_names=("dp", "tp"), device="h100"), example_inputs=(x,),
                     loss_fn=lm_loss, example_target=x, mode="semi_auto")


@pytest.mark.parametrize("shape,axis", [((2, 2), "d1"), ((2, 2), "d0"), ((4,), "tp"), ((4,), "d0")])
def test_auto_on_an_unnamed_mesh_keeps_the_annotations_axes(shape, axis):
    """Found by tests/ranks/test_fuzz.py: AUTO re-factors an unnamed mesh, and the first candidate without the
    annotated axis ended the search ("unknown mesh axis 'd1'; the mesh has axes ('d0',)", a mesh the user
    never gave). Candidates now keep the annotated axes (the mesh as given when they are its own), and
    DDP's layout, which keeps every weight whole, is not offered against an annotation that splits one."""
    model, x = _job()
    autopar.shard("blocks.*.fc1", weight={axis: autopar.Shard(0)})
    plan = autopar.plan(model, autopar.Mesh(shape, device="h100"), example_inputs=(x,), loss_fn=lm_loss,
                        example_target=x, mode="auto")
    assert axis in plan.mesh.axis_names, plan.mesh
    spec = plan.params["blocks.0.fc1.weight"].spec
    assert spec[plan.mesh.axis_index(axis)] == autopar.Shard(0), spec
    assert not any("DDP layout" in a.note for a in plan.alternatives), [a.note for a in plan.alternatives]


def test_an_axis_no_candidate_has_names_the_users_mesh():
    model, x = _job()
    autopar.shard("blocks.*.fc1", weight={"xx": autopar.Shard(0)})
    with pytest.raises(autopar.PlanError, match=r"unknown mesh axis 'xx'; the mesh has axes \('d0', 'd1'\)"):
        autopar.plan(model, autopar.Mesh((2, 2), device="h100"), example_inputs=(x,), loss_fn=lm_loss,
                     example_target=x, mode="auto")


# ---- a candidate whose solve runs out of the solver's time limit (issue 32) -------------------

def _auto(model, x):
    return autopar.plan(model, autopar.Mesh(4, device="h100"), example_inputs=(x,), loss_fn=lm_loss, example_target=x,
                        mode="auto")


def _timing_out(real, refuse):
    """``solve_on_mesh`` that raises SolverTimeoutError where ``refuse(mesh)``, else solves."""
    from autopar.solver.intra_op import SolverTimeoutError

    def solve(req, *args, **kwargs):
        if refuse(req.mesh):
            raise SolverTimeoutError(f"CP-SAT found no assignment within 0.01 s (mesh {req.mesh.shape}, test)")
        return real(req, *args, **kwargs)
    return solve


def test_a_candidate_that_times_out_is_listed_and_the_next_best_plan_returned(monkeypatch):
    """The best candidate's solve raising SolverTimeoutError (as CP-SAT's limit does on a loaded
    machine) drops that candidate with its reason; AUTO returns the runner-up of the same search."""
    from autopar.solver import search

    model, x = _job()
    full = _auto(model, x)
    best = (full.mesh.shape, full.mesh.axis_names)
    assert full.pipeline is None, full.degrees      # the tiny job's best is a mesh, not a pipeline
    runner_up = min((bool(a.redundant_axes), a.step_time) for a in full.alternatives if a.fits)[1]   # ``rank_key``
    monkeypatch.setattr(search, "solve_on_mesh", _timing_out(search.solve_on_mesh,
                                                             lambda m: (m.shape, m.axis_names) == best))
    plan = _auto(model, x)
    assert (plan.mesh.shape, plan.mesh.axis_names) != best
    assert plan.step_time == pytest.approx(runner_up, rel=1e-9), (plan.step_time, runner_up)
    notes = [a.note for a in plan.alternatives if not a.fits]
    assert any(n.startswith(f"mesh {best[0]}") and "CP-SAT found no assignment within 0.01 s" in n
               for n in notes), notes


def test_a_pipeline_candidate_that_times_out_does_not_end_the_search(monkeypatch):
    """A pipeline candidate's sub-mesh solve timing out (pipeline_search -> solve_on_mesh) is that
    candidate's failure: listed with its reason, the search returns the best of the others."""
    from autopar.solver import pipeline_search

    model, x = _job()
    full = _auto(model, x)
    monkeypatch.setattr(pipeline_search, "solve_on_mesh", _timing_out(pipeline_search.solve_on_mesh, lambda m: True))
    plan = _auto(model, x)
    assert plan.step_time == pytest.approx(full.step_time, rel=1e-9)
    notes = [a.note for a in plan.alternatives if not a.fits]
    assert any(n.startswith("pp=2 sub-mesh") and "CP-SAT found no assignment" in n for n in notes), notes


def test_when_every_candidate_times_out_the_error_names_the_limit(monkeypatch):
    from autopar.solver import pipeline_search, search
    from autopar.solver.fit_error import SearchTimeoutError

    model, x = _job()
    monkeypatch.setattr(search, "solve_on_mesh", _timing_out(search.solve_on_mesh, lambda m: True))
    monkeypatch.setattr(pipeline_search, "solve_on_mesh", _timing_out(pipeline_search.solve_on_mesh, lambda m: True))
    autopar.set_auto_parallel_context(solver_time_limit=3.0)
    try:
        with pytest.raises(SearchTimeoutError, match=r"no candidate gave a plan: the solve of \d+ candidate\(s\) "
                           r"\(mesh d0=4.*within the solver's time limit of 3 s; raise it "
                           r"\(autopar.set_auto_parallel_context\(solver_time_limit=12\)\)") as info:
            _auto(model, x)
    finally:
        autopar.reset_auto_parallel_context()
    assert any(t.startswith("pp=2") for t in info.value.timed_out), info.value.timed_out
    msg = str(info.value)
    assert "no plan fits memory" not in msg          # a timed-out candidate is not judged for memory
    # pipelines are tried at ZeRO 0 and 1, so each refused one counts twice; its reason is named once
    assert re.search(r"The other \d+ candidate\(s\): no pipeline plan fits: pp=4 sub-mesh \{'tp': 1\}: 2 layers < 4 "
                     r"stages$", msg), msg


def test_semi_auto_on_a_mesh_that_times_out_names_the_limit(monkeypatch):
    from autopar.solver import search
    from autopar.solver.fit_error import SearchTimeoutError

    model, x = _job()
    monkeypatch.setattr(search, "solve_on_mesh", _timing_out(search.solve_on_mesh, lambda m: True))
    with pytest.raises(SearchTimeoutError, match=r"mesh dp=2 × tp=2.*solver_time_limit="):
        autopar.plan(model, autopar.Mesh((2, 2), axis_names=("dp", "tp"), device="h100"), example_inputs=(x,),
                     loss_fn=lm_loss, example_target=x, mode="semi_auto")
