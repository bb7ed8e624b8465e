"""A candidate layout that violates a constraint of the job is dropped by AUTO with a one-line
reason in the alternatives, never an exception that ends the search (issue 15, part 4); the same
constraint on the user's own mesh is the error."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.plan import CandidateError
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
    """Found by tests/test_fuzz.py: AUTO re-factors an unnamed mesh, and the first candidate without the
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
