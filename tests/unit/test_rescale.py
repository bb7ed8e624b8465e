"""The step at a microbatch size derived from two traces (``graph/rescale.py``) is the graph a
direct trace gives, or nothing (the caller then traces again)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.graph.rescale import reference_batches, rescaled
from autopar.graph.retrace import Retracer, graph_fingerprint, microbatch_trace
from autopar.frontend.trace import trace
from examples.models import GPT, Llama


def _lm_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _cases():
    torch.manual_seed(0)
    x = torch.randint(0, 64, (8, 8))
    yield "gpt", GPT(vocab=64, hidden=32, heads=4, layers=2, seq=8), x
    yield "llama", Llama(vocab=64, hidden=32, heads=4, layers=2, seq=8, ffn=64), x


def _vals(gm):
    out = []
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        out.append((n.name, tuple(v.shape), v.dtype, v.requires_grad, v.stride()) if isinstance(v, torch.Tensor)
                   else (n.name, type(v).__name__))
    return out


@pytest.mark.parametrize("name,model,x", list(_cases()), ids=["gpt", "llama"])
@pytest.mark.parametrize("batch", [1, 2])
def test_rescaled_graph_is_the_direct_trace(name, model, x, batch):
    b1, b2 = reference_batches(8)
    first = trace(model, (x[:b1],), _lm_loss, x[:b1])
    got = rescaled(first, trace(model, (x[:b2],), _lm_loss, x[:b2]), batch)
    direct = trace(model, (x[:batch],), _lm_loss, x[:batch])
    assert got is not None
    assert got.gm.code == direct.gm.code
    assert graph_fingerprint(got.gm) == graph_fingerprint(direct.gm)
    assert _vals(got.gm) == _vals(direct.gm)
    assert (got.input_shapes, got.target_shape, got.batch_size) == (direct.input_shapes, direct.target_shape, batch)
    args = ([p.detach() for p in model.parameters()] + [b for b in model.buffers()] + [x[:batch], x[:batch]])
    torch.testing.assert_close(got.gm(*args), direct.gm(*args), rtol=0, atol=0)


def test_reference_batches():
    assert [reference_batches(b) for b in (1, 2, 4, 6, 8, 9, 12, 512)] == \
        [None, None, None, None, (4, 2), None, (6, 3), (256, 128)]


class _Squared(nn.Module):
    """A size that grows as the batch squared: not affine, so not rescaled."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        n = x.shape[0]
        return self.fc(x).sum() + x.new_zeros(n * n).sum()


class _FloatOfBatch(nn.Module):
    """A float argument that depends on the batch (1/B): not rescaled."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).sum() * (1.0 / x.shape[0])


@pytest.mark.parametrize("model", [_Squared(), _FloatOfBatch()], ids=["squared", "float"])
def test_graphs_that_do_not_rescale_are_traced_again(model):
    x = torch.randn(16, 4)
    assert rescaled(trace(model, (x[:8],)), trace(model, (x[:4],)), 2) is None
    mb = microbatch_trace(trace(model, (x,)), 2, Retracer(model, (x,)))
    assert not mb.meta.get("rescaled")
    assert mb.gm.code == trace(model, (x[:2],)).gm.code


def test_the_runtime_traces_what_planning_rescaled():
    model = GPT(vocab=64, hidden=32, heads=4, layers=1, seq=8)
    x = torch.randint(0, 64, (16, 8))
    big, retracer = trace(model, (x,), _lm_loss, x), Retracer(model, (x,), _lm_loss, x)
    planned = microbatch_trace(big, 2, retracer)
    assert planned.meta.get("rescaled")
    built = microbatch_trace(big, 2, retracer, rescale=False)
    assert built is not planned and not built.meta.get("rescaled")
    assert graph_fingerprint(built.gm) == graph_fingerprint(planned.gm)


class _CountingRetracer(Retracer):
    """A Retracer that records the batch sizes it traces."""

    def __call__(self, batch):
        self.__dict__.setdefault("batches", []).append(batch)
        return super().__call__(batch)


@pytest.mark.parametrize("shared", [False, True], ids=["own-target", "input-as-target"])
def test_the_global_step_serves_as_a_reference(shared):
    """The global graph matches the microbatch graphs (also where the tokens are passed again as
    the target: trace gives the target its own placeholder), so one reference trace suffices."""
    model = GPT(vocab=64, hidden=32, heads=4, layers=1, seq=8)
    x = torch.randint(0, 64, (16, 8))
    y = x if shared else x.clone()
    big, retracer = trace(model, (x,), _lm_loss, y), _CountingRetracer(model, (x,), _lm_loss, y)
    got = microbatch_trace(big, 2, retracer)
    assert got.meta.get("rescaled")
    assert retracer.batches == [reference_batches(16)[0]]
    direct = trace(model, (x[:2],), _lm_loss, y[:2])
    assert got.gm.code == direct.gm.code and _vals(got.gm) == _vals(direct.gm)


def test_a_global_graph_that_differs_falls_back_to_the_second_reference(monkeypatch):
    from autopar.graph import retrace

    model = GPT(vocab=64, hidden=32, heads=4, layers=1, seq=8)
    x = torch.randint(0, 64, (16, 8))
    big, retracer = trace(model, (x,), _lm_loss, x), _CountingRetracer(model, (x,), _lm_loss, x)
    real = retrace.rescaled
    monkeypatch.setattr(retrace, "rescaled", lambda first, second, b: None if second is big else real(first, second, b))
    got = microbatch_trace(big, 2, retracer)
    assert got.meta.get("rescaled") and retracer.batches == list(reference_batches(16))
    assert got.gm.code == trace(model, (x[:2],), _lm_loss, x[:2]).gm.code


def test_the_second_reference_size_is_rescaled_too(monkeypatch):
    """A pipeline's microbatch at the second reference size is derived from the first and the global
    step like any other (GPT-2 XL's search exported it for nothing); where the global graph does
    not rescale, it is traced once, without recursing into itself."""
    from autopar.graph import retrace

    model = GPT(vocab=64, hidden=32, heads=4, layers=1, seq=8)
    x = torch.randint(0, 64, (16, 8))
    b1, b2 = reference_batches(16)
    big, retracer = trace(model, (x,), _lm_loss, x), _CountingRetracer(model, (x,), _lm_loss, x)
    got = microbatch_trace(big, b2, retracer)
    assert got.meta.get("rescaled") and retracer.batches == [b1]
    assert got.gm.code == trace(model, (x[:b2],), _lm_loss, x[:b2]).gm.code
    big, retracer = trace(model, (x,), _lm_loss, x), _CountingRetracer(model, (x,), _lm_loss, x)
    monkeypatch.setattr(retrace, "rescaled", lambda first, second, b: None)
    got = microbatch_trace(big, b2, retracer)
    assert retracer.batches == [b1, b2] and not got.meta.get("rescaled")


def test_only_the_most_recent_microbatch_traces_are_kept(monkeypatch):
    """``KEPT_TRACES``: beyond the rescaling references, the least recently used microbatch traces
    are dropped (the newest counts among the kept); a dropped size is derived again (the same
    graph), without tracing again."""
    import autopar.graph.retrace as retrace

    monkeypatch.setattr(retrace, "KEPT_TRACES", 3)
    model = GPT(vocab=64, hidden=32, heads=4, layers=1, seq=8)
    x = torch.randint(0, 64, (48, 8))
    big, retracer = trace(model, (x,), _lm_loss, x.clone()), _CountingRetracer(model, (x,), _lm_loss, x.clone())
    refs = set(reference_batches(48))
    first = microbatch_trace(big, 2, retracer)
    for b in (3, 4, 2, 6):          # 2 used again: 3 is then the least recently used
        microbatch_trace(big, b, retracer)
    cache = big.meta["microbatch_traces"]
    assert set(cache) - refs == {4, 2, 6}
    assert microbatch_trace(big, 2, retracer) is first
    again = microbatch_trace(big, 3, retracer)
    assert set(cache) - refs == {2, 6, 3}
    assert graph_fingerprint(again.gm) == graph_fingerprint(trace(model, (x[:3],), _lm_loss, x[:3].clone()).gm)
    assert retracer.batches == [reference_batches(48)[0]]      # every size derived from the one reference


def _meta_cases():
    yield "llama", lambda: Llama(vocab=64, hidden=32, heads=4, layers=2, seq=8, ffn=64)
    from examples.hf_zoo import LogitsOnly, llama_config
    from transformers import LlamaForCausalLM
    yield "hf-llama", lambda: LogitsOnly(LlamaForCausalLM(llama_config(2, num_key_value_heads=2)))


@pytest.mark.parametrize("name,build", list(_meta_cases()), ids=["llama", "hf-llama"])
@pytest.mark.parametrize("mixed", [None, "bf16"])
def test_a_model_on_the_meta_device_rescales(name, build, mixed):
    """A model built on the meta device traces its own tensors (arange, zeros, ``.to``) onto the run
    device (``trace._retarget_device``): the propagation makes them on meta as export did, so the step
    rescales (it once fell back to an export per microbatch size: Llama-3 8B's pipeline search) and
    equals the direct trace."""
    with torch.device("meta"):
        model = build()
    x = torch.randint(0, 64, (8, 8), device="meta")
    b1, b2 = reference_batches(8)
    first = trace(model, (x[:b1],), _lm_loss, x[:b1], mixed)
    got = rescaled(first, trace(model, (x[:b2],), _lm_loss, x[:b2], mixed), 2)
    direct = trace(model, (x[:2],), _lm_loss, x[:2], mixed)
    assert got is not None
    assert got.gm.code == direct.gm.code
    assert graph_fingerprint(got.gm) == graph_fingerprint(direct.gm)
    assert _vals(got.gm) == _vals(direct.gm)


def test_a_meta_step_propagates_without_fake_tensors():
    """A step traced on the meta device is propagated on plain meta tensors (no fake-tensor dispatch,
    the cost of every pipeline microbatch size in AUTO's search), giving the direct trace's values."""
    from torch._subclasses.fake_tensor import FakeTensor
    from examples.hf_zoo import LogitsOnly, llama_config
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LogitsOnly(LlamaForCausalLM(llama_config(2, num_key_value_heads=2)))
    x = torch.randint(0, 64, (8, 8), device="meta")
    b1, b2 = reference_batches(8)
    first = trace(model, (x[:b1],), _lm_loss, x[:b1], "bf16")
    got = rescaled(first, trace(model, (x[:b2],), _lm_loss, x[:b2], "bf16"), 2)
    vals = [n.meta["val"] for n in got.gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    assert vals and not any(isinstance(v, FakeTensor) for v in vals)
    assert all(v.is_meta for v in vals)
    assert _vals(got.gm) == _vals(trace(model, (x[:2],), _lm_loss, x[:2], "bf16").gm)
