"""Any element-wise ``torch.optim`` optimizer, with an LR scheduler, trains on a rank's pieces like one
process: SGD (Nesterov momentum, weight decay) with OneCycleLR, Adam with LambdaLR, RMSprop with
StepLR and Adagrad, under a dp x tp plan and under the same plan with ZeRO-2 (flat shards). Optimizers
that need whole parameters (Adafactor, LBFGS) train under a DATA plan and are refused by name where a
plan splits parameters; SparseAdam is refused everywhere (runtime/optimizer_check.py)."""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import autopar
from conftest import run_ranks
from examples.models import MLP
from oracle import assert_same_training, assert_within_torch_noise, make_batch

STEPS = 3
BATCH = 64      # at 8 samples the (dp, tp) plan leaves dp unused


def _sgd(params):
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2)
    return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS)


def _adam(params):
    opt = torch.optim.Adam(params, lr=1e-2)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _rmsprop(params):
    opt = torch.optim.RMSprop(params, lr=1e-2, momentum=0.5)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def _adagrad(params):
    return torch.optim.Adagrad(params, lr=0.1), None


def _adafactor(params):
    return torch.optim.Adafactor(params, lr=1e-2), None


def _lbfgs(params):
    return torch.optim.LBFGS(params, lr=0.5, max_iter=3), None


ELEMENTWISE = {"sgd": _sgd, "adam": _adam, "rmsprop": _rmsprop, "adagrad": _adagrad}
WHOLE = {"adafactor": _adafactor, "lbfgs": _lbfgs}
SCALE_INVARIANT = {"adam", "rmsprop", "adagrad", "adafactor"}     # compared like AdamW (tests/oracle.py)


def _train(step, grads, params, make, steps=STEPS):
    """Steps of ``make``'s optimizer (and scheduler); LBFGS re-evaluates through a closure."""
    opt, sched = make()
    out = {"losses": [], "grads": [], "params": []}
    for _ in range(steps):
        if isinstance(opt, torch.optim.LBFGS):
            def closure():
                opt.zero_grad()
                return step()
            out["losses"].append(float(opt.step(closure)))
        else:
            out["losses"].append(float(step()))
            out["grads"].append({k: v.clone() for k, v in grads().items()})
            opt.step()
            opt.zero_grad()
        if sched is not None:
            sched.step()
        out["params"].append({k: v.clone() for k, v in params().items()})
    return out


def _reference(name: str, make):
    x, y = make_batch("vector", BATCH)
    torch.manual_seed(0)
    model = MLP()
    names = {id(p): n for n, p in model.named_parameters()}

    def step():
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss.detach()

    return _train(step, lambda: {names[id(p)]: p.grad for p in model.parameters() if p.grad is not None},
                  lambda: {k: v.detach() for k, v in model.state_dict().items()}, lambda: make(model.parameters()))


@functools.lru_cache(maxsize=None)
def _dp_tp_plan(zero: int) -> str:
    """A (dp=2, tp=2) Megatron MLP plan on 4 ranks, with ``zero`` forced."""
    x, y = make_batch("vector", BATCH)
    torch.manual_seed(0)
    model = MLP()
    autopar.shard({"layers.0": ColwiseParallel(), "layers.1": RowwiseParallel()}, axis="tp")
    mesh = autopar.Mesh((2, 2), axis_names=("dp", "tp"), device="a100-80gb")
    plan = autopar.plan(model, mesh, example_inputs=(x,), loss_fn=F.cross_entropy, example_target=y, mode="semi_auto")
    autopar.clear_annotations()
    return dataclasses.replace(plan, memory_options=dataclasses.replace(plan.memory_options, zero=zero)).to_json()


def _ddp_run(rank, make):
    """torch DDP on this rank's half of the batch: where LBFGS lands when only the sum order changes."""
    from torch.nn.parallel import DistributedDataParallel

    x, y = make_batch("vector", BATCH)
    world = torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = MLP()
    ddp = DistributedDataParallel(model)
    names = {id(p): n for n, p in model.named_parameters()}

    def step():
        loss = F.cross_entropy(ddp(x.chunk(world)[rank]), y.chunk(world)[rank])
        loss.backward()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        return total / world

    return _train(step, lambda: {names[id(p)]: p.grad for p in model.parameters() if p.grad is not None},
                  lambda: {k: v.detach() for k, v in model.state_dict().items()}, lambda: make(model.parameters()))


def _refusal(make, pmodel, step) -> str:
    opt, _ = make(pmodel.parameters())
    try:
        if isinstance(opt, torch.optim.LBFGS):
            opt.step(lambda: (opt.zero_grad(), step())[1])
        else:
            step()
            opt.step()
    except TypeError as err:
        return str(err)
    finally:
        opt.zero_grad()
    return ""


def _job(rank, plan_jsons: dict, names: list[str], refused: list[str]):
    x, y = make_batch("vector", BATCH)
    out = {}
    for key, js in plan_jsons.items():
        torch.manual_seed(0)
        if js is None:
            pmodel = autopar.parallelize(MLP(), autopar.Mesh(torch.distributed.get_world_size()), example_inputs=(x,),
                                         loss_fn=F.cross_entropy, example_target=y, mode="data")
        else:
            plan = autopar.Plan.from_json(js)
            pmodel = autopar.parallelize(MLP(), plan.mesh, example_inputs=(x,), loss_fn=F.cross_entropy,
                                         example_target=y, plan=plan)
        start = pmodel.full_state_dict()
        step = functools.partial(pmodel.step, x, target=y)
        for name in names:
            pmodel.load_full_state_dict(start)
            make = {**ELEMENTWISE, **WHOLE}[name]
            out[(key, name)] = _train(step, pmodel.full_grad_dict, pmodel.full_state_dict,
                                      lambda: make(pmodel.parameters()))
            out[(key, name)]["optim"] = "adamw" if name in SCALE_INVARIANT else name
        out[(key, "degrees")] = pmodel.plan.degrees
        if js is None and "lbfgs" in names:
            out[(key, "lbfgs", "ddp")] = _ddp_run(rank, _lbfgs)
        for name in refused:
            out[(key, "refused", name)] = _refusal({**WHOLE, "sparse_adam": lambda p: (torch.optim.SparseAdam(
                list(p)), None)}[name], pmodel, step)
    return out


def test_elementwise_optimizers_and_schedulers_train_like_one_process_under_dp_tp_and_zero():
    plans = {"dp2tp2": _dp_tp_plan(0), "dp2tp2 zero2": _dp_tp_plan(2)}
    names = list(ELEMENTWISE)
    results = run_ranks(4, _job, plans, names, ["adafactor", "lbfgs"])
    for name in names:
        ref = _reference(name, ELEMENTWISE[name])
        for r, res in enumerate(results):
            for key in plans:
                assert res[(key, "degrees")] == {"dp": 2, "tp": 2, "pp": 1, "ep": 1, "cp": 1}
                assert_same_training(ref, res[(key, name)], what=f"{name} {key} rank {r}")
    msg = results[0][("dp2tp2", "refused", "adafactor")]
    assert msg.startswith("torch.optim.Adafactor cannot train under this plan: it factors each matrix's second "
                          "moment"), msg
    assert "placed [R,S(0)] on mesh axes ('dp', 'tp')" in msg and "mode='data' with" in msg, msg
    msg = results[0][("dp2tp2 zero2", "refused", "lbfgs")]
    assert msg.startswith("torch.optim.LBFGS cannot train under this plan: its line search takes dot products"), msg
    assert "a ZeRO-2 shard over the data-parallel ranks" in msg, msg


def test_whole_tensor_optimizers_train_under_a_data_plan_and_sparse_adam_is_refused():
    results = run_ranks(2, _job, {"data": None}, list(WHOLE), ["sparse_adam"])
    ada, lbfgs = _reference("adafactor", _adafactor), _reference("lbfgs", _lbfgs)
    for r, res in enumerate(results):
        assert res[("data", "degrees")]["dp"] == 2
        assert_same_training(ada, res[("data", "adafactor")], what=f"adafactor DATA rank {r}")
        # LBFGS divides by curvature estimates: the data-parallel sum order moves it past 1e-5, as it moves DDP
        assert_within_torch_noise(lbfgs, res[("data", "lbfgs")], [res[("data", "lbfgs", "ddp")]],
                                  what=f"lbfgs DATA rank {r}")
    assert results[0][("data", "refused", "sparse_adam")].startswith(
        "torch.optim.SparseAdam cannot train an autopar module: it needs sparse gradients"), results[0]
