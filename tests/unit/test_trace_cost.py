"""The cheaper export and propagation of AUTO's traces give the graphs the costlier ones gave:
an export without per-node stack traces and with lazy graph modules (``frontend/export_settings.py``), and a rescale's meta
propagation without autograd history, each repeated op signature computed once (``graph/meta_memo.py``)."""
import contextlib
import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
import autopar.frontend.trace as trace_module
from autopar.frontend.trace import trace
from autopar.graph import meta_memo
from autopar.graph.rescale import reference_batches, rescaled
from autopar.graph.retrace import Retracer, graph_fingerprint, microbatch_trace
from examples.models import GPT


def _lm_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _vals(gm):
    out = []
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        out.append((n.name, tuple(v.shape), v.dtype, v.requires_grad, v.stride(), v.storage_offset(), v.device)
                   if isinstance(v, torch.Tensor) else (n.name, type(v).__name__))
    return out


def _hf_llama_on_meta():
    from examples.hf_zoo import LogitsOnly, llama_config
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LogitsOnly(LlamaForCausalLM(llama_config(2, num_key_value_heads=2)))


def test_the_cheaper_export_is_the_same_graph(monkeypatch):
    model = GPT(vocab=64, hidden=32, heads=4, layers=2, seq=8)
    x = torch.randint(0, 64, (4, 8))
    got = trace(model, (x,), _lm_loss, x)
    monkeypatch.setattr(trace_module, "export_settings", lambda record: contextlib.nullcontext())
    recorded = trace(model, (x,), _lm_loss, x)          # torch.export's defaults: stack traces, eager modules
    assert not any(n.meta.get("stack_trace") for n in got.gm.graph.nodes)
    assert any(n.meta.get("stack_trace") for n in recorded.gm.graph.nodes)
    assert got.gm.code == recorded.gm.code and graph_fingerprint(got.gm) == graph_fingerprint(recorded.gm)
    assert _vals(got.gm) == _vals(recorded.gm)
    for a, b in zip(got.gm.graph.nodes, recorded.gm.graph.nodes, strict=True):
        assert {k: v for k, v in a.meta.items() if k not in ("val", "stack_trace")}.keys() == \
            {k for k in b.meta if k not in ("val", "stack_trace")}, a.name
        assert (a.meta.get("nn_module_stack"), a.meta.get("module_path")) == \
            (b.meta.get("nn_module_stack"), b.meta.get("module_path")), a.name


def test_a_torch_without_the_stack_trace_switch_exports_as_before(monkeypatch):
    """torch 2.11 (the GPU machines' build) has no ``fx.config.do_not_emit_stack_traces``: the export
    records stack traces as torch's default does, and the graph is the same."""
    model = GPT(vocab=64, hidden=32, heads=4, layers=2, seq=8)
    x = torch.randint(0, 64, (4, 8))
    want = trace(model, (x,), _lm_loss, x)
    import types

    from autopar.frontend import export_settings

    monkeypatch.setattr(export_settings, "fx", types.SimpleNamespace(config=types.SimpleNamespace()))
    got = trace(model, (x,), _lm_loss, x)
    assert any(n.meta.get("stack_trace") for n in got.gm.graph.nodes)
    assert got.gm.code == want.gm.code and _vals(got.gm) == _vals(want.gm)


class _CountsFromValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        counts = torch.histc(x[:, 0], bins=2, min=-100, max=100)
        outs = [rows * (e + 1) for e, rows in enumerate(torch.split(self.fc(x), counts.long().tolist()))]
        return torch.cat(outs).sum()                      # split sizes from values: refused, its line named


def test_a_size_from_values_still_names_its_source_line():
    """The export records no stack traces; the error exports again with them to name the line."""
    lines, start = inspect.getsourcelines(_CountsFromValues.forward)
    line = start + next(i for i, text in enumerate(lines) if "tolist" in text)
    with pytest.raises(autopar.TraceError, match=rf"(?s)\(File .*test_trace_cost\.py\", line {line}, in forward\).*"
                                                 r"fixed shapes"):
        trace(_CountsFromValues(), (torch.randn(6, 4),))


@pytest.mark.parametrize("mixed", [None, "bf16"])
def test_memoised_propagation_equals_running_every_op(monkeypatch, mixed):
    """On a meta model with repeated layers: the memo is used, and every node's value (shape, stride,
    storage offset, dtype, device) equals propagation that runs every op, and the direct trace."""
    model = _hf_llama_on_meta()
    x = torch.randint(0, 64, (8, 8), device="meta")
    b1, b2 = reference_batches(8)
    first, second = (trace(model, (x[:b],), _lm_loss, x[:b], mixed) for b in (b1, b2))
    reused = []
    real_made = meta_memo._made
    monkeypatch.setattr(meta_memo, "_made", lambda d: reused.append(d) or real_made(d))
    got = rescaled(first, second, 2)
    assert got is not None and reused
    monkeypatch.setattr(meta_memo.MetaMemo, "call", lambda self, op, args, kwargs, run: run(op, args, kwargs))
    plain = rescaled(first, second, 2)
    direct = trace(model, (x[:2],), _lm_loss, x[:2], mixed)
    assert _vals(got.gm) == _vals(plain.gm) == _vals(direct.gm)
    assert got.gm.code == direct.gm.code


def test_only_fresh_outputs_are_memoised():
    aten = torch.ops.aten
    assert meta_memo._returns_fresh(aten.mm.default) and meta_memo._returns_fresh(aten.native_layer_norm.default)
    for op in (aten.view.default, aten.transpose.int, aten.split_with_sizes.default, aten.add_.Tensor,
               aten.copy_.default, aten.expand.default):
        assert not meta_memo._returns_fresh(op), op
    memo = meta_memo.MetaMemo()
    a = torch.empty_strided((4, 6), (1, 4), device="meta")
    b = torch.empty(6, 3, device="meta")
    first = memo.call(aten.mm.default, (a, b), {}, lambda op, args, kwargs: op(*args, **kwargs))
    again = memo.call(aten.mm.default, (a, b), {}, lambda op, args, kwargs: pytest.fail("ran twice"))
    assert again is not first
    assert (again.shape, again.stride(), again.dtype, again.storage_offset()) == \
        (first.shape, first.stride(), first.dtype, first.storage_offset())
    ran = []
    memo.call(aten.mm.default, (a.contiguous(), b), {}, lambda op, args, kwargs: ran.append(1) or op(*args))
    assert ran                           # another stride: another signature
    assert meta_memo._key(1) != meta_memo._key(1.0) != meta_memo._key(True)


class _BranchesOnBatch(nn.Module):
    """An extra op above 8 rows: the global step (16 rows) differs from the microbatches."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if x.shape[0] > 8:
            y = torch.relu(y)
        return y.sum()


class _CountingRetracer(Retracer):
    def __call__(self, batch):
        self.__dict__.setdefault("batches", []).append(batch)
        return super().__call__(batch)


def test_a_meta_model_branching_on_the_batch_falls_back_to_the_second_reference():
    with torch.device("meta"):
        model = _BranchesOnBatch()
    x = torch.randn(16, 4, device="meta")
    big, retracer = trace(model, (x,)), _CountingRetracer(model, (x,))
    assert rescaled(microbatch_trace(big, 8, retracer), big, 2) is None
    got = microbatch_trace(big, 2, retracer)
    direct = trace(model, (x[:2],))
    assert retracer.batches == list(reference_batches(16))
    assert got.gm.code == direct.gm.code and _vals(got.gm) == _vals(direct.gm)
