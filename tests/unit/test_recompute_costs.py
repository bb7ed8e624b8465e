"""Activation recomputation in one process: the cost functions (``cost_models/recompute.py``) on GPTs, the saved
bytes of a real step against the prediction, the region order of the lowering, and a mapping that names a layer the
model lacks. The oracle on ranks: tests/ranks/test_recompute.py."""
from __future__ import annotations

import functools

import pytest
import torch

import autopar
from autopar.cost_models.compute import node_cost
from autopar.cost_models.devices import get_device
from autopar.cost_models.memory import saved_activations
from autopar.cost_models.recompute import layer_options, recompute_cost
from autopar.graph.recompute_regions import choices_for, find_regions
from autopar.plan.plan import PlanError
from autopar.frontend.trace import trace
from bench.recompute import saved_bytes
from analytic_gpt import GPT as HandGPT
from examples.models import GPT, lm_loss
from oracle import assert_same_training, parallel_run
from recompute_jobs import DEVICE, VOCAB, _tokens, _with, gpt


def _gpt_graph(layers, batch=2, seq=32, hidden=32):
    x, y = _tokens(batch, seq)
    return trace(GPT(vocab=VOCAB, hidden=hidden, heads=2, layers=layers, seq=seq), (x,), lm_loss, y).gm


def test_full_recompute_keeps_only_each_layers_input():
    """A layer saves L = saved(2 layers) - saved(1 layer); recomputing it keeps only its input, b*s*h fp32."""
    batch, seq, hidden = 2, 32, 32
    one, two = _gpt_graph(1), _gpt_graph(2)
    per_layer = sum(saved_activations(two).values()) - sum(saved_activations(one).values())
    cost = recompute_cost(two, "full", get_device(DEVICE))
    for layer in ("blocks.0", "blocks.1"):
        assert cost.layers[layer].saved_bytes_removed == per_layer - batch * seq * hidden * 4
    assert cost.saved_bytes_removed == 2 * (per_layer - batch * seq * hidden * 4)
    assert cost.saved_bytes_after == cost.saved_bytes_before - cost.saved_bytes_removed
    # the extra time is the layers' forward, node by node
    dev = get_device(DEVICE)
    layer_fwd = sum(node_cost(n, dev).time_fwd for n in two.graph.nodes
                    if n.op == "call_function" and n.meta.get("module_path", "").startswith("blocks."))
    assert cost.extra_seconds == pytest.approx(layer_fwd, rel=1e-9)
    # one layer's choice is that layer's share
    single = recompute_cost(two, {"blocks.1": "full"}, dev)
    assert single.saved_bytes_removed == cost.layers["blocks.1"].saved_bytes_removed
    assert single.extra_seconds == pytest.approx(cost.extra_seconds / 2)


def test_selective_removes_the_heads_seq_squared_terms():
    """Hand-written attention: selective drops softmax output, dropout mask and dropped probabilities,
    5 a s^2 b bytes per layer (bf16, 1-byte masks), at the price of the attention core's forward only."""
    vocab, seq, h, heads, b = 1000, 128, 64, 4, 2
    with torch.device("meta"):
        model = HandGPT(vocab, seq, h, heads, 2).to(torch.bfloat16)
    idx = torch.zeros(b, seq, dtype=torch.long, device="meta")
    gm = trace(model, (idx, idx)).gm
    regions = find_regions(gm, choices_for(gm, "selective"))
    assert [r.name for r in regions] == ["recompute_blocks_0_attention", "recompute_blocks_1_attention"]
    assert regions[0].nodes[0] == "matmul" and "softmax" in regions[0].nodes and regions[0].nodes[-1] == "matmul_1"
    dev = get_device(DEVICE)
    options = layer_options(gm, dev)
    for layer in ("blocks.0", "blocks.1"):
        sel, full = options[layer]["selective"], options[layer]["full"]
        assert sel.saved_bytes_removed == 5 * heads * seq * seq * b
        assert 0 < sel.extra_seconds < full.extra_seconds
        assert full.saved_bytes_removed > sel.saved_bytes_removed
        assert options[layer]["none"].saved_bytes_removed == 0


def test_selective_on_sdpa_drops_its_logsumexp():
    """Fused attention keeps no s^2 terms: selective removes what only SDPA saves (b*heads*s fp32 logsumexp;
    its output is the projection's saved input on CPU layouts, but not counted twice either way)."""
    gm = _gpt_graph(2)
    cost = recompute_cost(gm, "selective", get_device(DEVICE))
    assert [r for layer in cost.layers.values() for r in layer.regions] == \
        ["recompute_blocks_0_attention", "recompute_blocks_1_attention"]
    assert 0 < cost.saved_bytes_removed < recompute_cost(gm, "full", get_device(DEVICE)).saved_bytes_removed


def test_except_attention_recomputes_the_layer_but_its_attention_core():
    """"except_attention": the nodes of "full" minus the SDPA call, as two convex regions per layer (before
    and after the core); the core's forward is not replayed, and it saves what it saved before."""
    gm = _gpt_graph(2)
    dev = get_device(DEVICE)
    regions = find_regions(gm, choices_for(gm, "except_attention"))
    assert [r.name for r in regions] == ["recompute_blocks_0_part_0", "recompute_blocks_0_part_1",
                                         "recompute_blocks_1_part_0", "recompute_blocks_1_part_1"]
    by_name = {n.name: n for n in gm.graph.nodes}
    inside = {n for r in regions for n in r.nodes}
    full = {n for r in find_regions(gm, choices_for(gm, "full")) for n in r.nodes}
    selective = find_regions(gm, choices_for(gm, "selective"))
    cores = {n for r in selective for n in r.nodes}
    assert cores and not cores & inside and inside == full - cores
    assert sum("scaled_dot_product" in str(by_name[n].target) for n in cores) == 2
    options = layer_options(gm, dev)
    for layer in ("blocks.0", "blocks.1"):
        kept, whole = options[layer]["except_attention"], options[layer]["full"]
        core = sum(node_cost(by_name[n], dev).time_fwd for r in selective if r.layer == layer for n in r.nodes)
        assert core > 0 and kept.extra_seconds == pytest.approx(whole.extra_seconds - core, rel=1e-9)
        assert 0 < kept.saved_bytes_removed < whole.saved_bytes_removed


def test_except_attention_without_an_attention_core_is_full():
    """A layer with no attention core (an MLP block) recomputes as one "full" region."""
    gm = trace(torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(2)]),
               (torch.randn(4, 8),)).gm
    full = find_regions(gm, choices_for(gm, "full"))
    kept = find_regions(gm, choices_for(gm, "except_attention"))
    assert full and [r.nodes for r in kept] == [r.nodes for r in full]


def _measured_saved(pmodel, *args, **kw) -> int:
    """Bytes autograd keeps for backward during one step, each storage once, parameters out."""
    return saved_bytes(lambda: pmodel.step(*args, **kw), pmodel.parameters())


@pytest.mark.parametrize("name", ["gpt_dropout", "hand_attention"])
def test_saved_bytes_drop_as_predicted(name):
    if name == "gpt_dropout":
        model_fn = functools.partial(GPT, vocab=VOCAB, hidden=32, heads=2, layers=2, seq=32, dropout=0.1)
        x, y = _tokens(4, 32)
        args, kw, trace_args = (x,), {"loss_fn": lm_loss, "example_target": y}, ((x,), lm_loss, y)
        step_kw = {"target": y}
    else:
        model_fn = functools.partial(HandGPT, VOCAB, 32, 32, 4, 2, p=0.1)
        x, y = _tokens(4, 32)
        args, kw, trace_args, step_kw = (x, y), {}, ((x, y),), {}
    gm = trace(model_fn(), *trace_args).gm
    plan = autopar.plan(model_fn(), autopar.Mesh(1), example_inputs=args, mode="stand_alone", **kw)
    measured = {}
    for choice in ("none", "full", "selective", "except_attention"):
        torch.manual_seed(0)
        pm = autopar.parallelize(model_fn(), autopar.Mesh(1), example_inputs=args, plan=_with(plan, choice), **kw)
        measured[choice] = _measured_saved(pm, *args, **step_kw)
    for choice in ("full", "selective", "except_attention"):
        predicted = recompute_cost(gm, choice, dropout_mask_bytes=None, node_seconds=lambda n: 0.0).saved_bytes_removed
        drop = measured["none"] - measured[choice]
        assert predicted > 0 and drop == pytest.approx(predicted, rel=0.10), (choice, drop, predicted)


def test_recompute_mapping_naming_a_missing_layer_is_refused():
    x, y = _tokens()
    plan = autopar.plan(gpt(), autopar.Mesh(1), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                        mode="stand_alone")
    with pytest.raises(PlanError, match=r"'blocks\.7'.*layers are: blocks\.0, blocks\.1"):
        autopar.parallelize(gpt(), autopar.Mesh(1), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                            plan=_with(plan, {"blocks.0": "full", "blocks.7": "selective"}))


def test_forward_only_and_eval_run_regions_plainly():
    x, y = _tokens()
    plan = autopar.plan(gpt(), autopar.Mesh(1), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                        mode="stand_alone")
    torch.manual_seed(0)
    pm = autopar.parallelize(gpt(), autopar.Mesh(1), example_inputs=(x,), loss_fn=lm_loss, example_target=y,
                             plan=_with(plan, "full"))
    torch.manual_seed(0)
    model = gpt()
    with torch.no_grad():
        assert torch.allclose(pm(x), model(x), atol=1e-6)
    assert "recompute_blocks_0 = self.recompute_blocks_0(" in pm.code


class _PeekBlock(torch.nn.Module):
    """Attention whose probabilities are also used outside the core, before ``P @ V`` runs."""

    def __init__(self, h=16):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(h, 3 * h), torch.nn.Linear(h, h)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        att = torch.nn.functional.dropout((q @ k.transpose(-2, -1)).softmax(-1), 0.2, self.training)
        peek = att.mean(-1, keepdim=True)
        return x + self.out(att @ v) * peek


class _Peek(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_PeekBlock() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum(-1)


def test_a_region_output_used_before_the_regions_end_is_reordered():
    x, y = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(2)), torch.randn(4, 8)
    loss = torch.nn.functional.mse_loss
    plan = autopar.plan(_Peek(), autopar.Mesh(1), example_inputs=(x,), loss_fn=loss, example_target=y,
                        mode="stand_alone")
    runs = [parallel_run(0, _Peek, loss, x, y, autopar.Mesh(1), None, plan=_with(plan, c), steps=2)
            for c in ("none", "selective", "full")]
    for r in runs[1:]:
        assert_same_training(runs[0], r, rtol=1e-6)
