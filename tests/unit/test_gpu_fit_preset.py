"""The H100 preset's measured rates (bench/gpu_fit.py, bench/RESULTS.md §GPU4) and the costs found by
comparing the H100's profile with the prediction: casts that change the dtype, the gradient sums of a
value several ops read, the mixed-precision working copies."""
import dataclasses
import json
import math
import statistics
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from autopar.cost_models.compute import grad_sum_work, node_cost, node_work
from autopar.cost_models.param_step import WORKING_COPY_BYTES, working_copy_time
from autopar.cost_models.devices import H100_ATTENTION_CURVE, H100_MATMUL_CURVE, get_device

FIT = Path(__file__).resolve().parents[2] / "bench" / "gpu_fit_h100.jsonl"
aten = torch.ops.aten


def _rows(kind):
    return [r for r in map(json.loads, FIT.read_text().splitlines()) if r.get("kind") == kind and "error" not in r]


def _export(model, *args):
    return torch.export.export(model, args, strict=False).graph_module


def test_the_h100_matmul_curve_is_the_median_of_the_recorded_measurement():
    by_dim = {}
    for r in _rows("matmul"):
        by_dim.setdefault(r["min_dim"], []).append(r["efficiency"])
    for dim, eff in H100_MATMUL_CURVE:
        if dim in by_dim:
            assert statistics.median(by_dim[dim]) == pytest.approx(eff, abs=0.01), dim
    assert {d for d, _ in H100_MATMUL_CURVE} >= {128, 256, 512, 1024, 2048, 4096}
    for name in ("h100", "h200", "h800"):
        dev = get_device(name)
        assert dev.matmul_efficiency == H100_MATMUL_CURVE and dev.attention_curve == H100_ATTENTION_CURVE


def test_the_h100_attention_curve_follows_the_keys_a_query_sees():
    # non-causal head dim 128 at S keys, causal at ~S/2: both forms read the same curve
    for r in _rows("attention"):
        if r["d"] != 128 or r["dv"] != 128:
            continue
        keys = r["seq"] / 2 if r["causal"] else r["seq"]
        if keys < H100_ATTENTION_CURVE[0][0]:
            continue
        assert get_device("h100").attention_eff(keys) == pytest.approx(r["efficiency"], abs=0.06), r


def test_attention_eff_interpolates_in_the_log_and_falls_back():
    dev = dataclasses.replace(get_device("h100"), attention_curve=((1000, 0.2), (4000, 0.6)))
    assert dev.attention_eff(2000) == pytest.approx(0.4)
    assert dev.attention_eff(10) == 0.2 and dev.attention_eff(10**6) == 0.6
    assert dataclasses.replace(dev, attention_curve=(), attention_efficiency=0.3).attention_eff(2000) == 0.3


def test_causal_attention_on_the_h100_runs_at_the_curve_of_half_its_keys():
    class Attn(nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    q = torch.zeros(1, 8, 4096, 128, dtype=torch.bfloat16, device="meta")
    gm = _export(Attn(), q, q, q)
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and "attention" in str(n.target))
    dev = dataclasses.replace(get_device("h100"), kernel_overhead=0.0)
    cost = node_cost(node, dev)
    work = node_work(node)
    eff = dev.attention_eff(4096 * (4097 / 2) / 4096)
    assert eff == pytest.approx(0.40, abs=0.01)      # measured causal at 4096: 0.38-0.39
    assert cost.time_fwd == pytest.approx(work.flops_fwd / (dev.flops_per_s(torch.bfloat16) * eff), rel=1e-6)


def test_a_cast_that_changes_the_dtype_is_a_kernel_and_one_that_does_not_is_free():
    class Cast(nn.Module):
        def forward(self, x):
            return x.to(torch.float32) * 2, x.to(torch.bfloat16) * 2, x.t().contiguous() * 2, x.contiguous() * 2

    gm = _export(Cast(), torch.zeros(64, 32, dtype=torch.bfloat16))
    to = [n for n in gm.graph.nodes if n.target == aten.to.dtype]
    assert len(to) == 2
    changed = next(n for n in to if n.args[1] == torch.float32)
    same = next(n for n in to if n.args[1] == torch.bfloat16)
    assert node_work(changed).bytes_fwd == 64 * 32 * (2 + 4) and node_work(changed).kernels_fwd == 1
    assert node_work(same).kernels_fwd == 0
    contig = [n for n in gm.graph.nodes if n.target == aten.contiguous.default]
    copies = sorted(node_work(n).kernels_fwd for n in contig)
    assert copies == [0, 1] or len(contig) == 1 and copies == [1]


class _Fan(nn.Module):
    """``h`` is read by three linears: its gradient is the sum of three."""

    def __init__(self):
        super().__init__()
        self.inp, self.a, self.b, self.c = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        h = self.inp(x)
        return self.a(h) + self.b(h) + self.c(h)


def test_a_value_three_ops_read_pays_two_gradient_sums_in_backward():
    gm = _export(_Fan(), torch.zeros(8, 16))
    linears = [n for n in gm.graph.nodes if n.target == aten.linear.default]
    h = linears[0]
    summed = grad_sum_work(h)
    assert summed is not None and summed.kernels_bwd == 2 and summed.bytes_bwd == 2 * 3 * 8 * 16 * 4
    # the sums' launches come on top of the op's own backward
    dev = dataclasses.replace(get_device("h100"), kernel_overhead=1e-3)
    assert node_cost(h, dev).launch_bwd == pytest.approx((node_work(h).kernels_bwd + 2) * 1e-3)
    assert all(grad_sum_work(n) is None for n in linears[1:])      # each read once


def test_the_mixed_precision_working_copy_costs_twelve_bytes_an_element_a_microbatch():
    dev = get_device("h100")
    n = 10**9
    t = working_copy_time(n, dev, "mixed")
    assert WORKING_COPY_BYTES == 12.0
    assert t == pytest.approx(n * 12 / (dev.memory_bandwidth * dev.memory_efficiency) + 2 * dev.kernel_overhead)
    assert working_copy_time(n, dev, "fp32") == 0.0 and working_copy_time(n, dev, "bf16") == 0.0
    assert math.isclose(working_copy_time(0, dev, "mixed"), 0.0)


def test_a_mixed_precision_plan_charges_the_working_copies_per_microbatch():
    from autopar.solver.strategy_prices import Costing, node_costs
    from autopar.sharding.strategy import Strategy
    from autopar.sharding.placements import Replicate

    gm = _export(_Fan(), torch.zeros(8, 16))
    w = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name.endswith("inp_weight"))
    st = Strategy((), (Replicate(),), (None,), "replicate")
    costs = {}
    for precision in ("fp32", "mixed"):
        c = Costing((1,), get_device("h100"), "adamw", precision)
        compute, _memory, once = node_costs(w, [st], c, {}, {w.name})
        costs[precision] = (compute[0], once[0])
    cast = working_copy_time(w.meta["val"].numel(), get_device("h100"), "mixed")
    assert costs["mixed"][0] - costs["fp32"][0] == pytest.approx(cast, rel=1e-9)
    assert costs["mixed"][1] == pytest.approx(costs["fp32"][1], rel=1e-9)      # not once per step
