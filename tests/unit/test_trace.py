"""Tracing: aten graph on fake/meta tensors, module paths, parameter names, tied parameters."""
from __future__ import annotations

import torch

from autopar.frontend.trace import trace
from examples.models import GPT, lm_loss
from oracle import make_batch


def test_trace_keeps_names_paths_shapes_and_ties():
    x, y = make_batch("tokens", 8)
    t = trace(GPT(qkv_bias=False), (x,), lm_loss, y)
    assert set(t.params.values()) >= {"wte.weight", "blocks.0.qkv.weight", "ln_f.bias"}
    assert t.aliases["wte.weight"] == ["wte.weight", "lm_head.weight"]
    assert list(t.params.values()).count("wte.weight") == 1, "a tied parameter is one graph input"
    nodes = {n.name: n for n in t.gm.graph.nodes}
    linear = next(n for n in nodes.values() if n.meta.get("module_path") == "blocks.0.qkv")
    assert tuple(linear.meta["val"].shape) == (8, 16, 192)
    assert t.has_loss and t.target is not None and t.input_shapes == [(8, 16)]


def test_meta_model_traces_without_memory():
    with torch.device("meta"):
        model = GPT(vocab=50000, hidden=512, layers=4, qkv_bias=False)
    x, y = make_batch("tokens", 4)
    t = trace(model, (x,), lm_loss, y)
    assert all(n.meta["val"].device.type == "meta" for n in t.gm.graph.nodes if n.op == "call_function"
               and isinstance(n.meta.get("val"), torch.Tensor))
