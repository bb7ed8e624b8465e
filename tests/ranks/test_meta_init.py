"""Models built on the meta device (docs/big_models.md): ``parallelize`` builds each rank's pieces
without weights, and ``pmodel.init_weights(seed)`` fills them with exactly what building the model on
one CPU under ``torch.manual_seed(seed)`` gives. For every plan kind of the feature matrix (and ZeRO,
accumulation with recomputation, a saved HYBRID plan), for Hugging Face models and for a model with
torchtitan's ``init_weights()``: the gathered state equals the one-device model bit for bit, then
the run trains like one device (the oracle, SGD with momentum, 1e-5)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.runtime.replay_init import InitReplayError
from conftest import run_ranks
from examples.hf_zoo import hf_model
from meta_models import ReplayableKitchen, TitanStyle, titan_reference
from oracle import assert_same_training, parallel_run, reference_run
from semantics_models import Kitchen, token_loss, tokens
from test_feature_matrix import BATCH, CLIP, DEVICE, MICRO, PLANS

SEED = 0
EXTRA = {          # name: (ranks, mesh shape, axis names, mode, annotate, autotune_top_k, context)
    "zero3_saved_plan": (2, (2,), None, "data", None, 0, {}),
    "accumulate_recompute": (2, (2,), None, "auto", None, 0, {"accumulation": 2, "recompute": "selective"}),
}
FAST = ("data", "tp", "pp", "zero3_saved_plan")


def _meta(make):
    def build():
        with torch.device("meta"):
            return make()
    return build


def _run_meta(rank, make, loss_fn, x, y, mesh, mode, **kw):
    """``oracle.parallel_run`` on a model built on meta, ``init_weights(SEED)`` right after ``parallelize``;
    the gathered state right after init is returned as ``out["initial"]``."""
    states, orig = [], autopar.parallelize

    def parallelize(*args, **kwargs):
        pm = orig(*args, **kwargs)
        assert all(p.device.type != "meta" for p in pm.parameters())
        pm.init_weights(SEED)
        states.append(pm.full_state_dict())
        return pm

    autopar.parallelize = parallelize
    try:
        out = parallel_run(rank, _meta(make), loss_fn, x, y, mesh, mode, **kw)
    finally:
        autopar.parallelize = orig
    out["initial"] = states[0]
    return out


def _zero3_plan(model, x, y, loss_fn, ranks: int, kwargs=None) -> str:
    plan = autopar.plan(model, autopar.Mesh(ranks), example_inputs=x, example_kwargs=kwargs, loss_fn=loss_fn,
                        example_target=y, mode="data")
    return dataclasses.replace(plan, memory_options=dataclasses.replace(plan.memory_options, zero=3)).to_json()


def _kitchen_job(rank, name):
    ranks, shape, names, mode, annotate, top_k, *ctx = {**PLANS, **EXTRA}[name]
    if top_k:
        autopar.set_auto_parallel_context(autotune_top_k=top_k, autotune_steps=1, autotune_slack=100.0)
    if ctx and ctx[0]:
        autopar.set_auto_parallel_context(**ctx[0])
    x, y = tokens(BATCH)
    mesh = autopar.Mesh(shape, axis_names=names, device=DEVICE)
    kw = {}
    if name == "zero3_saved_plan":
        kw["plan"] = autopar.Plan.from_json(_zero3_plan(_meta(ReplayableKitchen)(), (x[: BATCH // MICRO],),
                                                        y[: BATCH // MICRO], token_loss, ranks))
        mode = None
    return _run_meta(rank, ReplayableKitchen, token_loss, x, y, mesh, mode, setup=annotate, micro=MICRO, clip=CLIP,
                     **kw)


def _equal_state(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: keys differ: {set(got) ^ set(want)}"
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: not bit-equal to the one-device model: {bad}"


def _kitchen_case(name: str) -> None:
    torch.manual_seed(SEED)
    want = ReplayableKitchen().state_dict()
    x, y = tokens(BATCH)
    ctx = ({**PLANS, **EXTRA}[name][6:] or [{}])[0]
    ref = reference_run(ReplayableKitchen, token_loss, x, y, micro=MICRO, clip=CLIP,
                        accumulate=ctx.get("accumulation", 1))
    results = run_ranks({**PLANS, **EXTRA}[name][0], _kitchen_job, name)
    for r in results:
        _equal_state(r["initial"], want, f"kitchen {name} after init_weights")
        assert_same_training(ref, r, what=f"meta kitchen {name}")
    plan = autopar.Plan.from_json(results[0]["plan"])
    if name == "zero3_saved_plan":
        assert plan.memory_options.zero == 3
    if name == "accumulate_recompute":
        assert plan.memory_options.accumulation == 2 and plan.memory_options.recompute == "selective"


@pytest.mark.parametrize("name", FAST)
def test_meta_kitchen_matches_one_device(name):
    _kitchen_case(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in [*PLANS, *EXTRA] if n not in FAST])
def test_meta_kitchen_matches_one_device_slow(name):
    _kitchen_case(name)


def _hf_job(rank, name, plan_json):
    z = hf_model(name)
    plan = autopar.Plan.from_json(plan_json)
    args, kwargs = z.inputs
    with torch.device("meta"):
        model = hf_model(name).module
    pm = autopar.parallelize(model, plan.mesh, example_inputs=args, example_kwargs=kwargs or None,
                             loss_fn=z.loss_fn, example_target=z.target, plan=plan)
    pm.init_weights(SEED)
    state = pm.full_state_dict()
    opt = torch.optim.SGD(pm.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(2):
        losses.append(float(pm.step(*args, target=z.target, **kwargs)))
        opt.step()
        opt.zero_grad()
    return state, losses, pm.full_state_dict()


def _hf_reference(name):
    torch.manual_seed(SEED)
    z = hf_model(name)
    want = {k: v.clone() for k, v in z.module.state_dict().items()}
    opt = torch.optim.SGD(z.module.parameters(), lr=0.05, momentum=0.9)
    args, kwargs = z.inputs
    losses = []
    for _ in range(2):
        loss = z.loss_fn(z.module(*args, **kwargs), z.target)
        loss.backward()
        losses.append(float(loss))
        opt.step()
        opt.zero_grad()
    return z, want, losses, z.module.state_dict()


@pytest.mark.parametrize("name", ["gpt2", "llama", pytest.param("t5", marks=pytest.mark.slow),
                                  pytest.param("vit", marks=pytest.mark.slow)])
def test_meta_hf_model_matches_one_device(name):
    """A tiny Hugging Face model built on meta, ZeRO-3 over 2 ranks (every tensor cut into flat shards)."""
    z, want, losses, after = _hf_reference(name)
    with torch.device("meta"):
        meta = hf_model(name).module
    args, kwargs = z.inputs
    plan_json = _zero3_plan(meta, args, z.target, z.loss_fn, 2, kwargs or None)
    for state, got_losses, got_after in run_ranks(2, _hf_job, name, plan_json):
        _equal_state(state, want, f"{name} after init_weights")
        for a, b in zip(got_losses, losses):
            assert abs(a - b) <= 1e-5 * abs(b), f"{name} loss {a} != {b}"
        for k, v in after.items():
            assert torch.allclose(got_after[k], v, rtol=1e-5, atol=1e-6), f"{name} {k} after 2 steps"


def _titan_job(rank):
    x, y = tokens(BATCH)
    autopar.shard("layers.*", weight={"tp": autopar.Shard(0)})
    mesh = autopar.Mesh((2,), axis_names=("tp",), device=DEVICE)
    return _run_meta(rank, TitanStyle, token_loss, x, y, mesh, "semi_auto")


def test_meta_titan_style_init_weights_matches_one_device():
    """torchtitan's convention (meta, to_empty, seed, ``init_weights()``), tensor-parallel on 2 ranks."""
    want = titan_reference(SEED).state_dict()
    x, y = tokens(BATCH)
    ref = reference_run(lambda: titan_reference(SEED), token_loss, x, y)
    for r in run_ranks(2, _titan_job):
        _equal_state(r["initial"], want, "titan-style after init_weights")
        assert_same_training(ref, r, what="meta titan-style")
    plan = autopar.Plan.from_json(r["plan"])
    assert isinstance(plan.params["layers.0.weight"].spec[0], autopar.Shard)


# ---- what cannot be replayed: clear errors -------------------------------------------------------------
def _meta_single(make, x=None, y=None):
    x, y = tokens(4) if x is None else (x, y)
    with torch.device("meta"):
        model = make()
    return autopar.parallelize(model, autopar.Mesh(1), example_inputs=(x,), loss_fn=token_loss, example_target=y)


def test_random_numbers_drawn_in_init_are_refused_by_name():
    pm = _meta_single(Kitchen)        # pos = nn.Parameter(torch.randn(...)) in Kitchen.__init__
    with pytest.raises(InitReplayError, match=r"Kitchen.__init__ .*draws random numbers itself \('torch.randn'\).*"
                                              r"reset_parameters\(\)"):
        pm.init_weights()


class _Unwritten(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.out = nn.Linear(8, 32)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x):
        return self.out(self.emb(x) * self.scale)


def test_tensor_no_init_writes_is_named():
    with pytest.raises(InitReplayError, match=r"no initialization step writes scale .*reset_parameters\(\).*load"):
        _meta_single(_Unwritten).init_weights()


class _ReadsLater(_Unwritten):
    @torch.no_grad()
    def init_weights(self):
        nn.init.normal_(self.emb.weight)
        nn.init.normal_(self.out.weight)
        self.out.bias.copy_(self.emb.weight[0].repeat(4))   # reads emb.weight after moving on to out.weight
        self.scale.fill_(1.0)


def test_init_reading_a_tensor_already_cut_is_refused():
    with pytest.raises(InitReplayError, match=r"'out.bias'.*meta device"):
        _meta_single(_ReadsLater).init_weights()


class _ScalesLater(_Unwritten):
    @torch.no_grad()
    def init_weights(self):
        nn.init.normal_(self.emb.weight)
        nn.init.normal_(self.out.weight)
        nn.init.zeros_(self.out.bias)
        self.emb.weight.mul_(0.5)      # elementwise, after moving on: applied to the pieces
        self.scale.fill_(2.0)


def test_elementwise_op_after_moving_on_is_exact():
    with torch.device("meta"):
        model = _ScalesLater()
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    model.init_weights()
    pm = _meta_single(_ScalesLater)
    pm.init_weights(SEED)
    _equal_state(pm.full_state_dict(), model.state_dict(), "elementwise after moving on")


def test_init_weights_on_a_real_model_and_half_meta_model_are_refused():
    x, y = tokens(4)
    pm = autopar.parallelize(ReplayableKitchen(), autopar.Mesh(1), example_inputs=(x,), loss_fn=token_loss,
                             example_target=y)
    with pytest.raises(ValueError, match="initializes a model given to parallelize.. on the meta device"):
        pm.init_weights()
    model = ReplayableKitchen()
    with torch.device("meta"):
        model.head = nn.Linear(16, 32, bias=False)
    with pytest.raises(ValueError, match=r"tensors on the meta device and others not \(pos, emb.weight"):
        autopar.parallelize(model, autopar.Mesh(1), example_inputs=(x,), loss_fn=token_loss, example_target=y)
