"""Mixture of experts in one process: which modules become one ``autopar::moe_experts`` node, their
cost, the per-rank program always running the local implementation (STAND_ALONE, eval mode), and
the errors of ``op_strategy``."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.cost_models.compute import node_work
from autopar.frontend import moe_experts
from autopar.frontend.trace import trace
from moe_models import batch, lm_loss, moe_lm
from oracle import assert_same_training, parallel_run, reference_run

pytest.importorskip("transformers")

MOE = torch.ops.autopar.moe_experts.default


def _moe_nodes(gm):
    return [n for n in gm.graph.nodes if n.target is MOE]


def test_each_experts_module_is_one_node_with_its_facts_and_flops():
    x, y = batch()
    model = moe_lm("mixtral")
    gm = trace(model, (x,), lm_loss, y).gm
    nodes = _moe_nodes(gm)
    assert [n.meta["module_path"] for n in nodes] == [f"inner.model.layers.{i}.mlp.experts" for i in range(2)]
    assert not [n for n in gm.graph.nodes if "grouped_mm" in str(n.target) or "histc" in str(n.target)]
    e = moe_experts.entry(nodes[0].args[0])
    assert (e.num_experts, e.top_k, e.param_names) == (4, 2, ("gate_up_proj", "down_proj"))
    assert e.has_gate and not e.has_bias and not e.is_transposed
    per_expert = sum(p.numel() for p in model.inner.model.layers[0].mlp.experts.parameters()) // 4
    assert e.per_expert_numel == per_expert
    work = node_work(nodes[0])
    rows = x.numel() * 2
    assert work.flops_fwd == 2.0 * rows * per_expert and work.flops_bwd == 2 * work.flops_fwd
    # the real implementation is the module's own forward
    experts = model.inner.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(0)
    h, idx, w = torch.randn(6, 32, generator=g), torch.randint(0, 4, (6, 2), generator=g), torch.rand(6, 2, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(MOE(nodes[0].args[0], h, idx, w, list(experts.parameters())), experts(h, idx, w))


def test_an_experts_module_whose_parameters_do_not_lead_with_the_expert_dim_is_traced_through():
    from transformers.integrations.moe import use_experts_implementation
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    @use_experts_implementation
    class ScaledExperts(MixtralExperts):
        def __init__(self, config):
            super().__init__(config)
            self.scale = nn.Parameter(torch.ones(config.hidden_size))      # no expert dim

        def forward(self, hidden_states, top_k_index, top_k_weights):
            return super().forward(hidden_states, top_k_index, top_k_weights) * self.scale

    model = moe_lm("mixtral")
    for layer in model.inner.model.layers:
        layer.mlp.experts = ScaledExperts(model.inner.config)
    experts = model.inner.model.layers[0].mlp.experts
    assert "parameter(s) ['scale'] do not have num_experts=4 as dim 0" in moe_experts.why_not_opaque(experts)
    x, y = batch()
    gm = trace(model, (x,), lm_loss, y).gm
    assert not _moe_nodes(gm)
    assert [n for n in gm.graph.nodes if n.meta.get("module_path", "").endswith("mlp.experts")], "traced through"
    assert moe_experts.why_not_opaque(nn.Linear(2, 2)).startswith("not a transformers experts module")


def test_stand_alone_and_eval_run_the_local_implementation():
    """On one device and STAND_ALONE every experts node is the local implementation (the op has no
    autograd), in training and in the eval-mode retrace; training equals one device."""
    x, y = batch(rows=4)
    ref = reference_run(moe_lm, lm_loss, x, y, steps=2)
    seen = {}

    def inspect(pmodel):
        seen["train"] = pmodel.code
        pmodel.eval()
        seen["eval"] = pmodel.code
        with torch.no_grad():
            seen["out"] = pmodel(x)
        return None

    par = parallel_run(0, moe_lm, lm_loss, x, y, autopar.Mesh(1), "stand_alone", steps=2, inspect=inspect)
    assert_same_training(ref, par)
    for mode in ("train", "eval"):
        assert seen[mode].count("autopar_collectives_moe_dispatch_moe_experts(") == 2, seen[mode][:2000]
        assert "torch.ops.autopar.moe_experts" not in seen[mode], f"{mode}: the custom op runs as itself"
    torch.manual_seed(0)
    model = moe_lm()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(par["params"][-1][name])
        torch.testing.assert_close(seen["out"], model.eval()(x), rtol=1e-5, atol=1e-6)


def test_an_unregistered_key_says_to_trace_first():
    with pytest.raises(RuntimeError, match=r"no experts module registered under 'nope' in this process; trace the "
                                           r"model in this process"):
        moe_experts.entry("nope")


def test_op_strategy_errors_name_the_fault():
    model, (x, y) = moe_lm("mixtral", experts=3), batch()
    mesh = autopar.Mesh(2, axis_names=("dp",))
    autopar.op_strategy("inner.model.layers.*.mlp.experts", dp="ep")
    with pytest.raises(ValueError, match=r"op_strategy\('inner.model.layers.\*.mlp.experts', dp='ep'\) matches no op "
                                         r"with such a strategy.*divide"):
        autopar.plan(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, mode="semi_auto")
    autopar.clear_annotations()
    autopar.op_strategy("inner.model.layers.*.mlp.experts", tp="ep")
    with pytest.raises(ValueError, match=r"the mesh has no axis 'tp'; its axes are \['dp'\]"):
        autopar.plan(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, mode="semi_auto")
    with pytest.raises(TypeError, match="module-path glob"):
        autopar.op_strategy(model, dp="ep")
    with pytest.raises(ValueError, match="at least one axis=strategy name"):
        autopar.op_strategy("layers.*")


def test_a_piece_torchs_grouped_gemm_refuses_runs_the_same_math_in_bmm():
    """Expert tensor parallelism over several axes can leave an fp32 piece of 6 columns, which
    ``torch._grouped_mm`` refuses; the experts op then runs the module's batched_mm form."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(hidden_size=16, intermediate_size=6, num_local_experts=4, num_experts_per_tok=2)
    cfg._experts_implementation = "grouped_mm"
    module = MixtralExperts(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    hidden = torch.randn(8, 16, generator=g)
    index = torch.randint(0, 4, (8, 2), generator=g)
    weights = torch.rand(8, 2, generator=g)
    with pytest.raises(RuntimeError, match="multiple of 16 bytes"):
        module(hidden, index, weights)
    key = moe_experts._register(module, moe_experts._template(module), 2)
    got = moe_experts.run_experts(key, hidden, index, weights, list(module.parameters()))
    cfg._experts_implementation = "batched_mm"
    torch.testing.assert_close(got, module(hidden, index, weights))
