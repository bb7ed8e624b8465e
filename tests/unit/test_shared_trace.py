"""Rank 0's traced graph, packed and rebuilt in another process (``frontend/shared_trace.py``): the
same nodes, names, targets, arguments and meta (FakeTensors re-made with their shape, stride, dtype,
device and ``requires_grad``), and None where the graph holds an op only the tracing process can run."""
from __future__ import annotations

import pickle

import pytest
import torch

from autopar.frontend.shared_trace import pack_traced, unpack_traced
from autopar.frontend.trace import trace
from autopar.graph.chunk_hints import mark_chunk_hints
from autopar.graph.retrace import graph_fingerprint
from examples.models import GPT, lm_loss
from oracle import make_batch
from semantics_models import StraightThroughRound


def _fake_description(v):
    return (tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, v.device, v.requires_grad)


@pytest.mark.parametrize("mixed_precision", [None, "bf16"])
def test_a_packed_graph_comes_back_the_same(mixed_precision):
    x, y = make_batch("tokens", 8)
    traced = trace(GPT(qkv_bias=False, layers=2, hidden=32), (x,), lm_loss, y, mixed_precision)
    mark_chunk_hints(traced.gm)
    got = unpack_traced(pickle.loads(pickle.dumps(pack_traced(traced))))
    assert graph_fingerprint(got.gm) == graph_fingerprint(traced.gm)
    assert got.gm.code == traced.gm.code
    for a, b in zip(traced.gm.graph.nodes, got.gm.graph.nodes, strict=True):
        assert (a.op, a.name, a.target) == (b.op, b.name, b.target)
        assert str(a.args) == str(b.args) and str(a.kwargs) == str(b.kwargs), a.name
        assert a.meta.keys() == b.meta.keys(), a.name
        for key in ("module_path", "nn_module_stack", "stack_trace", "chunk_hint"):
            assert a.meta.get(key) == b.meta.get(key), (a.name, key)
        va, vb = a.meta.get("val"), b.meta.get("val")
        if isinstance(va, torch.Tensor):
            assert _fake_description(va) == _fake_description(vb), a.name
    for field in ("params", "buffers", "inputs", "target", "aliases", "buffer_mutations", "loss_index",
                  "output_leaves", "input_shapes", "target_shape", "has_loss", "meta", "input_dtypes",
                  "target_dtype", "signature"):
        assert getattr(got, field) == getattr(traced, field), field
    assert got.output_tree == traced.output_tree
    args = [torch.randn(v.shape) if v.is_floating_point() else torch.randint(0, 8, v.shape)
            for v in (n.meta["val"] for n in traced.gm.graph.nodes if n.op == "placeholder")]
    if mixed_precision is None:          # the rebuilt graph runs and computes what the traced one does
        torch.testing.assert_close(got.gm(*args), traced.gm(*args))


class _Rounded(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return StraightThroughRound.apply(self.lin(x))


def test_a_graph_with_an_op_only_its_process_can_run_is_not_packed():
    x = torch.randn(4, 8)
    traced = trace(_Rounded(), (x,), lambda out, t: (out - t).pow(2).mean(), torch.randn(4, 8))
    assert any(getattr(n.target, "namespace", None) == "autopar" for n in traced.gm.graph.nodes)
    assert pack_traced(traced) is None
