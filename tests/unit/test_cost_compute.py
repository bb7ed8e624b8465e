import dataclasses

import pytest
import torch
import torch.nn as nn

from autopar.cost_models.compute import OpCost, graph_cost, local_node_cost, node_cost, node_work, total_flops
from autopar.cost_models.devices import DeviceSpec, Link, get_device

from analytic_gpt import GPT


def export_gpt(vocab, seq, h, heads, layers, batch, sdpa=False, dtype=torch.float32):
    with torch.device("meta"):
        model = GPT(vocab, seq, h, heads, layers, sdpa).to(dtype)
    idx = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return torch.export.export(model, (idx, idx), strict=False).graph_module


def export(model, *args):
    return torch.export.export(model, args, strict=False).graph_module


def nodes(gm, target):
    return [n for n in gm.graph.nodes if n.target is target]


aten = torch.ops.aten
TOY = DeviceSpec(
    name="toy",
    peak_flops={"fp32": 1e12, "tf32": 1e12, "bf16": 4e12, "fp16": 4e12},
    memory_bytes=2**30,
    memory_bandwidth=1e11,
    intra_node_link=Link(1e10, 1e-6),
    inter_node_link=Link(1e9, 1e-5),
    devices_per_node=8,
    compute_efficiency=0.5,
    memory_efficiency=0.5,
    kernel_overhead=1e-6,
)


@pytest.mark.parametrize(
    "vocab,seq,h,heads,layers,batch,sdpa",
    [(1000, 128, 256, 4, 2, 2, False), (5000, 256, 512, 8, 2, 2, False), (3000, 512, 256, 4, 1, 1, True)],
)
def test_gpt_training_flops_match_narayanan(vocab, seq, h, heads, layers, batch, sdpa):
    """72 B s l h^2 (1 + s/(6h) + V/(12 l h)) for fwd + bwd without recomputation; the causal SDPA
    (``sdpa``) does (s+1)/(2s) of the attention term (the hand-written one masks a full square)."""
    gm = export_gpt(vocab, seq, h, heads, layers, batch, sdpa)
    attention = seq / (6 * h) * ((seq + 1) / (2 * seq) if sdpa else 1.0)
    expected = 72 * batch * seq * layers * h * h * (1 + attention + vocab / (12 * layers * h))
    assert total_flops(gm) == pytest.approx(expected, rel=0.02)


def test_linear_cost_and_roofline():
    gm = export(nn.Linear(512, 1024), torch.randn(64, 512))
    (node,) = nodes(gm, aten.linear.default)
    cost = node_cost(node, TOY)
    assert cost.flops_fwd == 2 * 64 * 512 * 1024
    # the input needs no gradient: weight-grad mm (2mnk) and bias sum (uncounted) only
    assert cost.flops_bwd == cost.flops_fwd
    assert cost.bytes_fwd == 4 * (64 * 512 + 1024 * 512 + 1024 + 64 * 1024)
    compute = cost.flops_fwd / (1e12 * 0.5)
    memory = cost.bytes_fwd / (1e11 * 0.5)
    assert cost.time_fwd == pytest.approx(max(compute, memory) + 1e-6)
    assert cost.time_total == pytest.approx(cost.time_fwd + cost.time_bwd)


def test_skinny_matmuls_pay_their_efficiency():
    """A matmul's FLOPs run at the device's efficiency for its smallest dimension: 8 tokens
    through a linear cost more per FLOP than 512."""
    dev = dataclasses.replace(TOY, memory_bandwidth=1e15, kernel_overhead=0.0,
                              matmul_efficiency=((8, 0.1), (512, 0.8)))
    per_flop = []
    for tokens in (8, 512):
        (node,) = nodes(export(nn.Linear(512, 512), torch.randn(tokens, 512)), aten.linear.default)
        cost = node_cost(node, dev)
        assert cost.time_fwd == pytest.approx(cost.flops_fwd / (1e12 * dev.matmul_eff(tokens)))
        per_flop.append(cost.time_total / cost.flops_total)
    assert per_flop[0] == pytest.approx(8 * per_flop[1])


def test_local_cost_of_a_split_matmul_uses_its_local_shape():
    """4 data-parallel ranks give each a quarter of the tokens: the local matmul is skinnier."""
    dev = dataclasses.replace(TOY, memory_bandwidth=1e15, matmul_efficiency=((16, 0.1), (64, 0.8)))
    gm = export(nn.Linear(256, 256), torch.randn(64, 256))
    (node,) = nodes(gm, aten.linear.default)
    x, w, b = node.all_input_nodes
    base = node_cost(node, dev)
    local = local_node_cost(node, {x: (16, 256), w: (256, 256), b: (256,)}, dev)
    assert local.flops_fwd == base.flops_fwd / 4
    assert local.time_fwd > base.scaled(4).time_fwd * 5
    assert local_node_cost(nodes(export(nn.ReLU(), torch.randn(4)), aten.relu.default)[0], {}, dev) is None


def test_backward_follows_parameters():
    """An input-only linear does weight-grad work only; inside a model it also back-propagates."""
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    gm = export(model, torch.randn(32, 256))
    first, second = nodes(gm, aten.linear.default)
    assert node_cost(first, TOY).flops_bwd == 2 * 32 * 256 * 256  # dW
    assert node_cost(second, TOY).flops_bwd == 4 * 32 * 256 * 256  # dW + dX
    gm2 = export(torch.nn.Flatten(), torch.randn(4, 3, 5))  # no parameters at all
    assert sum(c.flops_bwd + c.time_bwd for c in graph_cost(gm2, TOY).values()) == 0


def test_views_inputs_outputs_are_free():
    gm = export_gpt(500, 64, 64, 4, 1, 2)
    costs = graph_cost(gm, TOY)
    for node in gm.graph.nodes:
        free = node.op in ("placeholder", "output") or node.target in (
            aten.view.default,
            aten.transpose.int,
            aten.split.Tensor,
        ) or node.name.startswith("getitem")
        if free:
            assert costs[node.name] == OpCost(0, 0, 0, 0, 0, 0), node.name
    assert set(costs) == {n.name for n in gm.graph.nodes}


def test_fallback_formulas():
    gm = export_gpt(500, 64, 64, 4, 1, 2, sdpa=True)
    (sdpa,) = nodes(gm, aten.scaled_dot_product_attention.default)
    work = node_work(sdpa)
    assert work.flops_fwd == 4 * 2 * 4 * 64 * 64 * 16 * (65 / 128)  # 2 matmuls of 2*b*heads*s*s*d, causal share
    assert work.flops_bwd == 2 * work.flops_fwd
    gelu_gm = export(nn.Sequential(nn.Linear(8, 8), nn.GELU()), torch.randn(4, 8))
    (gelu,) = nodes(gelu_gm, aten.gelu.default)
    assert node_work(gelu).flops_fwd == 32 and node_work(gelu).flops_bwd == 64
    emb_gm = export(nn.Embedding(1000, 16), torch.zeros(4, 8, dtype=torch.long))
    (emb,) = nodes(emb_gm, aten.embedding.default)
    w = node_work(emb)
    assert w.flops_fwd == 0 and w.bytes_fwd == 4 * 8 * 8 + 2 * 4 * 8 * 16 * 4  # indices + rows + out


def test_conv_uses_flop_counter():
    gm = export(nn.Conv2d(3, 8, 3, padding=1), torch.randn(2, 3, 16, 16))
    (conv,) = nodes(gm, aten.conv2d.default)
    assert node_work(conv).flops_fwd == 2 * 2 * 8 * 16 * 16 * 3 * 9


def test_scaled_divides_work_not_launches():
    cost = OpCost(8.0, 16.0, 80.0, 160.0, 1.0 + 1e-3, 2.0 + 2e-3, 1e-3, 2e-3)
    half = cost.scaled(2)
    assert (half.flops_fwd, half.flops_bwd, half.bytes_fwd, half.bytes_bwd) == (4.0, 8.0, 40.0, 80.0)
    assert half.time_fwd == pytest.approx(0.5 + 1e-3) and half.time_bwd == pytest.approx(1.0 + 2e-3)
    with pytest.raises(ValueError):
        cost.scaled(0)


def test_bf16_is_faster_on_tensor_cores():
    fp32 = export(nn.Linear(4096, 4096), torch.randn(4096, 4096))
    bf16 = export(nn.Linear(4096, 4096).to(torch.bfloat16), torch.randn(4096, 4096, dtype=torch.bfloat16))
    a100 = get_device("a100-80gb")
    t32 = node_cost(nodes(fp32, aten.linear.default)[0], a100).time_fwd
    t16 = node_cost(nodes(bf16, aten.linear.default)[0], a100).time_fwd
    assert t32 / t16 == pytest.approx(16, rel=0.05)


def test_node_work_follows_a_changed_value():
    """``node_work`` caches a node's signature while its values stay the same objects; a new value
    (a graph rescaled to another batch in place) is costed again."""
    gm = export(nn.Linear(512, 1024), torch.randn(64, 512))
    (node,) = nodes(gm, aten.linear.default)
    assert node_work(node).flops_fwd == 2 * 64 * 512 * 1024
    x = next(a for a in node.all_input_nodes if tuple(a.meta["val"].shape) == (64, 512))
    with x.meta["val"].fake_mode:
        x.meta["val"] = torch.empty(32, 512)
        node.meta["val"] = torch.empty(32, 1024)
    assert node_work(node).flops_fwd == 2 * 32 * 512 * 1024


def _sdpa_node(seq: int, causal: bool, target=aten.scaled_dot_product_attention.default):
    """One SDPA node on (1, 2, seq, 16) fake query, key and value."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = torch.fx.Graph()
    with FakeTensorMode():
        vals = [torch.empty(1, 2, seq, 16, requires_grad=True) for _ in range(3)]
    ins = []
    for name, v in zip("qkv", vals):
        ins.append(g.placeholder(name))
        ins[-1].meta["val"] = v
    if target is aten.scaled_dot_product_attention.default:
        node = g.call_function(target, tuple(ins), {"is_causal": causal})
    else:       # _scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal)
        node = g.call_function(target, (*ins, 0.0, causal))
    with FakeTensorMode(allow_non_fake_inputs=True):
        node.meta["val"] = torch.ops.aten.scaled_dot_product_attention(*vals, is_causal=causal)
    g.output(node)
    return node


@pytest.mark.parametrize("target", [aten.scaled_dot_product_attention.default,
                                    aten._scaled_dot_product_flash_attention_for_cpu.default])
def test_causal_attention_counts_the_visible_half(target):
    """is_causal SDPA costs S(S+1)/2 of the S^2 score entries, forward and backward: cheaper than the
    non-causal op, the ratio tending to 1/2 at long S (the flag read by the op's schema, so the CPU
    flash variant, whose flag is its fifth argument, counts the same)."""
    from autopar.cost_models.causal_attention import causal_fraction, visible_entries

    assert visible_entries(4, 4) == 10 and visible_entries(2, 4) == 3 and visible_entries(4, 2) == 7
    ratios = []
    for seq in (8, 64, 1024):
        causal, full = node_work(_sdpa_node(seq, True, target)), node_work(_sdpa_node(seq, False, target))
        assert full.flops_fwd > 0 and causal.flops_fwd < full.flops_fwd and causal.flops_bwd < full.flops_bwd
        assert causal.flops_fwd == pytest.approx(full.flops_fwd * causal_fraction(seq, seq))
        assert causal.flops_bwd == pytest.approx(full.flops_bwd * (seq + 1) / (2 * seq))
        ratios.append(causal.flops_fwd / full.flops_fwd)
    assert ratios[0] > ratios[1] > ratios[2] and ratios[-1] == pytest.approx(0.5, abs=1e-3)
    assert node_cost(_sdpa_node(1024, True, target), TOY).time_fwd < node_cost(_sdpa_node(1024, False, target), TOY).time_fwd
