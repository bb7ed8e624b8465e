"""The lowering (insert_collectives, split_stages) is right for every layout the rules allow, not
only for the ones today's cost model happens to pick: plans chosen under randomly perturbed
costs (tensor, data and pipeline parallel), and hand-edited decisions, train like single-device;
a plan that does not fit the graph is refused."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.passes.insert_collectives import insert_collectives
from autopar.passes.split_stages import Transfer
from autopar.runtime.pipeline import PipelineExecutor
from autopar.solver import mesh_solve
from autopar.solver.greedy import feasible_hint
from autopar.frontend.trace import trace
from conftest import run_ranks
from examples.models import CNN, GPT, MLP, Bert, Llama, lm_loss
from oracle import assert_same_training, make_batch, parallel_run, reference_run
from test_pipeline import MODELS as PP_MODELS
from test_tensor_parallel import DEVICE, MESHES, MODELS, _memory_cap


class RMSHead(nn.Module):
    """Linear -> RMSNorm (a mean over the hidden dim) -> Linear."""

    def __init__(self, d=16, classes=4):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.out = nn.Linear(d, classes)

    def forward(self, x):
        h = self.inp(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return self.out(h).sum(1)


def _rms_batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 4, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def _rms_plan_split_mean() -> autopar.Plan:
    """A tp=2 plan whose RMSNorm mean reduces the split hidden dim to a partial sum (S(2) -> P,
    rescaled locally); its consumer needs the value replicated."""
    x, y = _rms_batch()
    torch.manual_seed(0)
    plan = autopar.plan(RMSHead(), autopar.Mesh((2,), axis_names=("tp",), device=DEVICE), example_inputs=(x,),
                        loss_fn=F.cross_entropy, example_target=y, mode="auto")
    name = next(k for k, d in plan.nodes.items() if d.op == "aten.mean.dim")
    plan.nodes[name] = dataclasses.replace(plan.nodes[name], strategy="S2→P", inputs=["[S(2)]"], output="[P]",
                                           local=["mean:scale"])
    return plan


def _rms_job(rank, plan_json):
    x, y = _rms_batch()
    plan = autopar.Plan.from_json(plan_json)
    return parallel_run(rank, RMSHead, F.cross_entropy, x, y, plan.mesh, None, plan=plan)


def test_split_mean_feeds_a_consumer_that_needs_it_whole():
    """The local rescale after a split mean keeps the mean's placement, so the collective its
    consumer needs is inserted (it was skipped, and the partial value used as if whole)."""
    x, y = _rms_batch()
    ref = reference_run(RMSHead, F.cross_entropy, x, y)
    for r in run_ranks(2, _rms_job, _rms_plan_split_mean().to_json()):
        assert_same_training(ref, r, what="split mean")


def _perturbed(seed: int, time_limit_s: float | None = None):
    """solve_intra_op on costs scaled by random factors (e^N(0, 1.5)): another valid layout
    (``time_limit_s``: CP-SAT's limit, when any feasible layout will do; the hint it falls back
    to is then the greedy layout of the perturbed costs)."""
    rng = np.random.default_rng(seed)
    solve = mesh_solve.solve_intra_op

    def noisy(a):
        a = np.array(a, dtype=float)
        ok = np.isfinite(a) & (a < 1e17)
        a[ok] = a[ok] * np.exp(rng.normal(0, 1.5, ok.sum())) + rng.exponential(1e-6, ok.sum())
        return a

    def run(p):
        nodes = [dataclasses.replace(n, compute=noisy(n.compute)) for n in p.nodes]
        edges = [dataclasses.replace(e, cost=noisy(e.cost)) for e in p.edges]
        q = dataclasses.replace(p, nodes=nodes, edges=edges)
        if time_limit_s is not None:   # the fallback: the perturbed costs' greedy layout, not the unperturbed one
            q = dataclasses.replace(q, time_limit_s=min(p.time_limit_s, time_limit_s), hint=feasible_hint(q))
        return solve(q)

    return run


def _random_plan(monkeypatch, name, mesh_key, seed) -> autopar.Plan:
    model_fn, loss_fn, kind, kw, _ = MODELS[name]
    n, shape, axes = MESHES[mesh_key]
    x, y = make_batch(kind, 8, **kw)
    # 2 s per solve: any layout the perturbed costs give will do (at the 10 s default the llama case
    # planned for 127-213 s, a quarter of the suite)
    monkeypatch.setattr(mesh_solve, "solve_intra_op", _perturbed(seed, time_limit_s=2.0))
    torch.manual_seed(0)
    mesh = autopar.Mesh(shape, axis_names=axes, device=DEVICE, memory_gb=_memory_cap(name, mesh_key))
    return autopar.plan(model_fn(), mesh, example_inputs=(x,), loss_fn=loss_fn, example_target=y, mode="auto")


def _model_job(rank, name, plan_json):
    model_fn, loss_fn, kind, kw, _ = MODELS[name]
    x, y = make_batch(kind, 8, **kw)
    plan = autopar.Plan.from_json(plan_json)
    return parallel_run(rank, model_fn, loss_fn, x, y, plan.mesh, None, plan=plan)


# The (dp2, tp2) Llama and GPT cases are slow (the suite's two longest plans): the layout cases below
# lower random (dp2, tp2) layouts of both (split mean, vocab-split loss and embedding among them), and
# llama-tp2 and gpt-tp4 here keep the full-size models with a memory cap in the default run.
RANDOM_CASES = [pytest.param("llama", "dp2tp2", 2, marks=pytest.mark.slow), ("llama", "tp2", 6),
                pytest.param("gpt", "dp2tp2", 1, marks=pytest.mark.slow),
                pytest.param("bert", "dp2tp2", 3, marks=pytest.mark.slow),
                ("gpt", "tp4", 4), ("cnn", "dp2tp2", 5), ("mlp", "tp4", 7)]


@pytest.mark.parametrize("name,mesh_key,seed", RANDOM_CASES)
def test_plans_under_random_costs_train_like_single_device(monkeypatch, name, mesh_key, seed):
    plan = _random_plan(monkeypatch, name, mesh_key, seed)
    model_fn, loss_fn, kind, kw, _ = MODELS[name]
    x, y = make_batch(kind, 8, **kw)
    ref = reference_run(model_fn, loss_fn, x, y)
    for r in run_ranks(MESHES[mesh_key][0], _model_job, name, plan.to_json()):
        assert_same_training(ref, r, what=f"{name} {mesh_key} seed {seed}")


# Many layouts of small models, every plan of one (model, mesh) trained in one call to the ranks:
# a layout costs a plan (~0.1 s) and a short run, not a test of its own.
SMALL_MODELS = {
    "mlp": (MLP, F.cross_entropy, "vector"),
    "cnn": (CNN, F.cross_entropy, "image"),                      # batch norm: synced statistics
    "gpt": (functools.partial(GPT, qkv_bias=False, layers=1, hidden=32), lm_loss, "tokens"),
    "llama": (functools.partial(Llama, layers=1, hidden=32, ffn=64), lm_loss, "tokens"),   # RMSNorm's mean
    "bert": (functools.partial(Bert, layers=1, hidden=32), F.cross_entropy, "classify_tokens"),
}
MANY_CASES = [("mlp", "dp2tp2", range(100, 106)), ("cnn", "dp2tp2", range(100, 108)),
              ("gpt", "dp2tp2", range(100, 105)), ("llama", "dp2tp2", range(100, 104)),
              ("bert", "dp2tp2", range(100, 104)), ("cnn", "tp2", range(100, 103)),
              ("gpt", "tp2", range(100, 104))]
MANY_STEPS = 2          # the second step checks the first update; a third adds time, not layouts
LOCAL_NAMES = {"loss:batch", "loss:vocab", "batch_norm:sync", "embedding:vocab", "mean:scale"}
_LOCALS_SEEN: set = set()


def _layouts(monkeypatch, name, mesh_key, seeds) -> list[autopar.Plan]:
    """The distinct layouts that ``seeds`` give (a layout: every node's strategy and placements)."""
    model_fn, loss_fn, kind = SMALL_MODELS[name]
    _, shape, axes = MESHES[mesh_key]
    x, y = make_batch(kind, 8)
    plans = {}
    for seed in seeds:
        monkeypatch.setattr(mesh_solve, "solve_intra_op", _perturbed(seed, time_limit_s=1.0))
        torch.manual_seed(0)
        plan = autopar.plan(model_fn(), autopar.Mesh(shape, axis_names=axes, device=DEVICE), example_inputs=(x,),
                            loss_fn=loss_fn, example_target=y, mode="auto")
        key = tuple(sorted((k, d.strategy, str(d.inputs), str(d.output)) for k, d in plan.nodes.items()))
        plans.setdefault(key, (seed, plan))
    return list(plans.values())


def _many_job(rank, name, plan_jsons):
    model_fn, loss_fn, kind = SMALL_MODELS[name]
    x, y = make_batch(kind, 8)
    out = []
    for plan_json in plan_jsons:
        plan = autopar.Plan.from_json(plan_json)
        out.append(parallel_run(rank, model_fn, loss_fn, x, y, plan.mesh, None, steps=MANY_STEPS, plan=plan))
    return out


# the CNN on dp2 x tp2 runs with the slow cases (its batch norm stays in cnn-tp2); the rest still lower every
# local implementation (``test_many_layouts_covered_every_local_implementation`` checks it in the default run)
MANY_SLOW = {("cnn", "dp2tp2")}


@pytest.mark.parametrize("name,mesh_key,seeds", [
    pytest.param(n, m, s, id=f"{n}-{m}", marks=[pytest.mark.slow] if (n, m) in MANY_SLOW else []) for n, m, s in MANY_CASES])
def test_many_layouts_under_random_costs_train_like_single_device(monkeypatch, name, mesh_key, seeds):
    """Issue 12: more layouts, 1-D and 2-D meshes, local implementations among them (vocab- and
    batch-split losses, synced batch norm, vocab-split embedding, split mean)."""
    layouts = _layouts(monkeypatch, name, mesh_key, seeds)
    assert len(layouts) >= len(seeds) // 2, f"{name} {mesh_key}: the seeds give only {len(layouts)} layouts"
    model_fn, loss_fn, kind = SMALL_MODELS[name]
    x, y = make_batch(kind, 8)
    ref = reference_run(model_fn, loss_fn, x, y, steps=MANY_STEPS)
    results = run_ranks(MESHES[mesh_key][0], _many_job, name, [p.to_json() for _, p in layouts])
    for rank_results in results:
        for (seed, plan), r in zip(layouts, rank_results):
            assert_same_training(ref, r, what=f"{name} {mesh_key} seed {seed} ({plan.degrees})")
    _LOCALS_SEEN.update(loc for _, p in layouts for d in p.nodes.values() for loc in d.local if loc)


def test_many_layouts_covered_every_local_implementation():
    """Runs after the cases above (same module, file order): together they lowered every local
    implementation a rule can produce."""
    if len(_LOCALS_SEEN) == 0:
        pytest.skip("the layout cases did not run in this session")
    assert LOCAL_NAMES <= _LOCALS_SEEN, f"no layout used {sorted(LOCAL_NAMES - _LOCALS_SEEN)}"


def _pp_job(rank, name, plan_json):
    autopar.set_auto_parallel_context(schedule="1f1b", microbatches=2)
    x, y = make_batch("tokens", 8)
    plan = autopar.Plan.from_json(plan_json)
    return parallel_run(rank, PP_MODELS[name], lm_loss, x, y, plan.mesh, None, plan=plan)


PP_CASES = [("gpt", ("pp", "tp"), 2), ("llama", ("pp", "tp"), 4), ("gpt", ("pp", "dp"), 1)]


@pytest.mark.parametrize("name,axes,seed", PP_CASES)
def test_pipeline_plans_under_random_costs_train_like_single_device(monkeypatch, name, axes, seed):
    """GPT's tied embedding: when one gather of the weight serves the embedding (stage 0) and the
    head (stage 1), each stage gathers its own copy (the gathered weight crossed the cut with
    the shape of its unsharded piece, and the pipeline hung)."""
    autopar.set_auto_parallel_context(schedule="1f1b", microbatches=2)
    x, y = make_batch("tokens", 8)
    monkeypatch.setattr(mesh_solve, "solve_intra_op", _perturbed(seed))
    torch.manual_seed(0)
    plan = autopar.plan(PP_MODELS[name](), autopar.Mesh((2, 2), axis_names=axes, device=DEVICE), example_inputs=(x,),
                        loss_fn=lm_loss, example_target=y, mode="auto")
    assert plan.degrees["pp"] == 2
    ref = reference_run(PP_MODELS[name], lm_loss, x, y)
    for r in run_ranks(4, _pp_job, name, plan.to_json()):
        assert_same_training(ref, r, what=f"{name} {axes} seed {seed}")


def test_a_stage_sending_a_value_of_the_wrong_shape_fails_clearly():
    t = Transfer(0, "add_2", 0, 1, (2, 16, 32), torch.float32)
    ex = PipelineExecutor({}, None, [t], lambda stage: 1, 0, {}, None, None)
    with pytest.raises(RuntimeError, match=r"the activation of transfer 0 \(add_2\), microbatch 0, is \(2, 16, 16\) "
                                           r"torch.float32 but its peer expects \(2, 16, 32\)"):
        ex._send(t, 0, False, torch.zeros(2, 16, 16), [])


def _rms_graph():
    x, y = _rms_batch()
    torch.manual_seed(0)
    return trace(RMSHead(), (x,), F.cross_entropy, y)


def test_a_plan_without_a_nodes_placement_is_refused():
    plan = _rms_plan_split_mean()
    name = next(k for k, d in plan.nodes.items() if d.op == "aten.rsqrt.default")
    del plan.nodes[name]
    traced = _rms_graph()
    with pytest.raises(autopar.PlanError, match=rf"the plan has no placement for {name} .*make a new one"):
        insert_collectives(traced.gm, plan, ("tp",), (2,), set(traced.params))


def test_a_plan_with_the_wrong_number_of_input_placements_is_refused():
    plan = _rms_plan_split_mean()
    name = next(k for k, d in plan.nodes.items() if d.op == "aten.mean.dim")
    plan.nodes[name] = dataclasses.replace(plan.nodes[name], inputs=["[S(2)]", "[R]"])
    traced = _rms_graph()
    with pytest.raises(autopar.PlanError, match=rf"the plan gives {name} .* 2 input placement\(s\) but it has 1 "
                                                r"tensor input\(s\)"):
        insert_collectives(traced.gm, plan, ("tp",), (2,), set(traced.params))
