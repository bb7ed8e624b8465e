"""Training semantics ordinary models rely on, each through the oracle (SGD with momentum, so a
gradient-scale error shows): parameters used through a slice, frozen and unused parameters,
gradient accumulation (with and without ``no_sync``), ranks seeded differently, and a HYBRID plan
applied on the wrong mesh."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.plan.plan import PlanError
from conftest import run_ranks
from oracle import assert_same_training, parallel_run, reference_run
from examples.models import GPT
from semantics_models import SEQ, VOCAB, Frozen, Sliced, Unused, token_loss, tokens

MODELS = {"sliced": Sliced, "frozen": Frozen, "unused": Unused}


def _job(rank, name, mode, micro):
    x, y = tokens(24)
    return parallel_run(rank, MODELS[name], token_loss, x, y, autopar.Mesh(4), mode, micro=micro)


@pytest.mark.parametrize("name", list(MODELS))
def test_sliced_frozen_unused_parameters_train_like_one_device(name):
    x, y = tokens(24)
    ref = reference_run(MODELS[name], token_loss, x, y)
    for r in run_ranks(4, _job, name, "data", 1):
        assert_same_training(ref, r, what=f"{name} data")
    if name == "frozen":
        plan = autopar.Plan.from_json(r["plan"])
        assert not plan.params["emb.weight"].trainable and plan.params["emb.weight"].grad_sync == []
        assert "emb.weight" not in r["grads"][0]
    if name == "unused":
        plan = autopar.Plan.from_json(r["plan"])
        assert not plan.params["spare"].trainable and plan.params["spare"].grad_sync == []


def _requires_grad_job(rank):
    x, y = tokens(8)
    pm = autopar.parallelize(Frozen(), autopar.Mesh(4), example_inputs=(x,), loss_fn=token_loss, example_target=y,
                             mode="data")
    pm.step(x, target=y)
    return {n: (p.requires_grad, p.grad is not None) for n, p in pm.named_parameters()}


def test_frozen_parameters_stay_frozen_in_the_per_rank_module():
    flags = run_ranks(4, _requires_grad_job)[0]
    assert flags["emb.weight"] == (False, False)
    assert flags["fc.weight"] == (True, True)


@pytest.mark.parametrize("mode", ["data", "auto"])
def test_gradient_accumulation_equals_backward_per_micro_batch(mode):
    x, y = tokens(24)
    ref = reference_run(Sliced, token_loss, x, y, micro=3)
    for r in run_ranks(4, _job, "sliced", mode, 3):
        assert_same_training(ref, r, what=f"accumulation {mode}")


def _no_sync_job(rank):
    from autopar.collectives.comm import count_collectives

    x, y = tokens(24)
    torch.manual_seed(0)
    pm = autopar.parallelize(Sliced(), autopar.Mesh(4), example_inputs=(x[:8],), loss_fn=token_loss,
                             example_target=y[:8], mode="data")
    opt = torch.optim.SGD(pm.parameters(), lr=0.05, momentum=0.9)
    with count_collectives() as c:
        with pm.no_sync():
            pm.step(x[:8], target=y[:8])
            pm.step(x[8:16], target=y[8:16])
        quiet = len([k for k in c.calls if k[3] == "bwd"])
    pm.step(x[16:], target=y[16:])          # DDP's idiom: the last micro-batch outside no_sync
    grads_a = pm.full_grad_dict()
    opt.zero_grad()
    with pm.no_sync():                      # every micro-batch inside: the optimizer's step sums them
        for i in range(3):
            pm.step(x[8 * i: 8 * i + 8], target=y[8 * i: 8 * i + 8])
    opt.step()
    return quiet, grads_a, pm.full_state_dict()


def test_no_sync_accumulates_locally_and_sums_once():
    x, y = tokens(24)
    torch.manual_seed(0)
    model = Sliced()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for i in range(3):
        token_loss(model(x[8 * i: 8 * i + 8]), y[8 * i: 8 * i + 8]).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    for i in range(3):
        token_loss(model(x[8 * i: 8 * i + 8]), y[8 * i: 8 * i + 8]).backward()
    opt.step()
    for quiet, grads, state in run_ranks(4, _no_sync_job):
        assert quiet == 0, "steps inside no_sync() communicated"
        for k, g in want.items():
            assert (grads[k] - g).norm() <= 1e-5 * g.norm(), k
        for k, v in model.state_dict().items():
            assert (state[k] - v).norm() <= 1e-5 * v.norm(), k


def _gpt():
    return GPT(vocab=VOCAB, hidden=16, heads=2, layers=2, seq=SEQ)


SEEDED = {"sliced": Sliced, "gpt": _gpt}


def _unseeded_job(rank, name, mode, shape, names):
    x, y = tokens(8)
    torch.manual_seed(100 + rank)           # every rank initialises its own model differently
    mesh = autopar.Mesh(shape, axis_names=names, device="a100-80gb")
    pm = autopar.parallelize(SEEDED[name](), mesh, example_inputs=(x,), loss_fn=token_loss, example_target=y,
                             mode=mode)
    return pm.full_state_dict(), {n: p.detach().clone() for n, p in pm.named_parameters()}


@pytest.mark.parametrize("name,mode,shape,names", [("sliced", "stand_alone", (4,), None),
                                                   ("sliced", "data", (4,), None),
                                                   ("gpt", "auto", (2, 2), ("pp", "dp"))])
def test_ranks_seeded_differently_train_rank_0s_model(name, mode, shape, names):
    results = run_ranks(4, _unseeded_job, name, mode, shape, names)
    torch.manual_seed(100)
    rank0 = SEEDED[name]().state_dict()
    for full, local in results:
        for k, v in rank0.items():
            assert torch.equal(full[k], v), f"{mode}: {k} differs from rank 0's"
        for k, t in local.items():
            if t.shape == rank0[k].shape:
                assert torch.equal(t, rank0[k]), f"{mode}: this rank's {k} differs from rank 0's"


def _hybrid_wrong_mesh(rank, text):
    x, y = tokens(8)
    with pytest.raises(PlanError, match=r"made for mesh .*d0=4.* but parallelize\(\) got mesh .*d0=1"):
        autopar.parallelize(Sliced(), autopar.Mesh(1), example_inputs=(x,), loss_fn=token_loss, example_target=y,
                            plan=autopar.Plan.from_json(text))
    return True


def test_hybrid_plan_for_another_mesh_is_refused():
    x, y = tokens(8)
    plan = autopar.plan(Sliced(), autopar.Mesh(4), example_inputs=(x,), loss_fn=token_loss, example_target=y,
                        mode="data")
    assert _hybrid_wrong_mesh(0, plan.to_json())
