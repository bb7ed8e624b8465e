import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.cost_models.memory import (
    MemoryBreakdown,
    activation_peak_bytes,
    inflight_microbatches,
    optimizer_state_bytes,
    param_bytes,
    param_numel,
    peak_breakdown,
    saved_activations,
    training_state_bytes_per_param,
)

from analytic_gpt import GPT


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
            nn.Flatten(), nn.Linear(32, 10),
        )  # fmt: skip

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y)


def export(model, *args):
    return torch.export.export(model, args, strict=False).graph_module


def measured_saved_bytes(model, *args):
    """Bytes autograd keeps for backward in a real run, each storage once, parameters out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*args)
    return sum(storages.values())


def gpt_meta(vocab, seq, h, heads, layers, dtype=torch.float32):
    with torch.device("meta"):
        model = GPT(vocab, seq, h, heads, layers).to(dtype)
    idx = torch.zeros(2, seq, dtype=torch.long, device="meta")
    return export(model, idx, idx)


@pytest.mark.parametrize("vocab,seq,h,layers", [(1000, 128, 256, 2), (3000, 256, 512, 1)])
def test_gpt_parameter_count(vocab, seq, h, layers):
    """12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)), plus the final LayerNorm's 2h."""
    gm = gpt_meta(vocab, seq, h, 4, layers)
    expected = 12 * layers * h * h * (1 + 13 / (12 * h) + (vocab + seq) / (12 * layers * h))
    assert param_numel(gm) == pytest.approx(expected + 2 * h, abs=0.5)
    assert param_bytes(gm) == 4 * param_numel(gm)
    assert param_bytes(gm, precision="bf16") == 2 * param_numel(gm)


def test_training_state_bytes():
    assert training_state_bytes_per_param("adamw", "bf16") == 16
    assert training_state_bytes_per_param("adam", "fp16") == 16
    assert training_state_bytes_per_param("adam", "fp32") == 16
    assert training_state_bytes_per_param("sgd", "fp32") == 8
    assert optimizer_state_bytes(10, "sgd") == 0
    assert optimizer_state_bytes(10, "sgd_momentum") == 40
    assert optimizer_state_bytes(10, "adamw") == 80
    assert optimizer_state_bytes(10, "adamw", "bf16") == 120  # + fp32 master weights
    with pytest.raises(ValueError, match="known"):
        optimizer_state_bytes(1, "lion")


def test_activations_per_layer_match_korthikanti():
    """34 s b h + 5 a s^2 b bytes per layer (bf16, 1-byte dropout masks), from l=2 minus l=1."""
    vocab, seq, h, heads, batch = 1000, 256, 256, 4, 2
    per_model = [sum(saved_activations(gpt_meta(vocab, seq, h, heads, l, torch.bfloat16)).values()) for l in (1, 2)]
    expected = 34 * seq * batch * h + 5 * heads * seq * seq * batch
    assert per_model[1] - per_model[0] == pytest.approx(expected, rel=0.10)


def _check_against_real_run(model, *args):
    model.train()
    estimate = sum(saved_activations(export(model, *args), dropout_mask_bytes=None).values())
    real = measured_saved_bytes(model, *args)
    assert estimate == pytest.approx(real, rel=0.10)
    return estimate


def test_saved_matches_autograd_mlp():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
    _check_against_real_run(mlp, torch.randn(32, 64))


def test_saved_matches_autograd_cnn():
    torch.manual_seed(0)
    _check_against_real_run(CNN(), torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)))


@pytest.mark.parametrize("sdpa", [False, True])
def test_saved_matches_autograd_gpt(sdpa):
    torch.manual_seed(0)
    idx = torch.randint(0, 500, (2, 64))
    _check_against_real_run(GPT(500, 64, 64, 4, 2, sdpa=sdpa), idx, idx)


def test_views_of_one_base_count_once():
    gm = gpt_meta(500, 64, 64, 4, 1)
    saved = saved_activations(gm)
    # q, k, v are views of one qkv output; the two matmuls keep contiguous copies of q and k^T
    assert not any(name.startswith(("getitem", "view", "transpose_")) for name in saved if name != "transpose")


class TanhChain(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(1000, 1000, bias=False)

    def forward(self, x):
        return torch.tanh(torch.tanh(self.lin(x)) * 2)


def test_liveness_chain():
    """x -> linear -> tanh -> *2 -> tanh: linear keeps x, tanh keeps its output, the linear
    output and the product die after their single use."""
    prof = activation_peak_bytes(export(TanhChain(), torch.randn(10, 1000)))
    act = 10 * 1000 * 4
    assert prof.saved == {"x": act, "tanh": act, "tanh_1": act}
    assert prof.saved_bytes == 3 * act
    assert prof.peak_bytes == 4 * act  # x, tanh, product and the last tanh at once
    assert prof.peak_node == "tanh_1"


def test_peak_breakdown_adds_up():
    gm = gpt_meta(500, 64, 64, 4, 2)
    mb = peak_breakdown(gm, "adamw", "bf16")
    assert isinstance(mb, MemoryBreakdown)
    n = param_numel(gm)
    assert mb.params + mb.grads + mb.optimizer == 16 * n
    assert mb.total == mb.params + mb.grads + mb.optimizer + mb.activations + mb.transient
    sharded = peak_breakdown(gm, "adamw", "bf16", param_shard=4, inflight=3)
    assert sharded.optimizer == mb.optimizer // 4
    assert sharded.activations == 3 * mb.activations


def test_inflight_microbatches():
    assert inflight_microbatches("gpipe", 4, 0, 8) == 8
    assert inflight_microbatches("1f1b", 4, 0, 8) == 4
    assert inflight_microbatches("1f1b", 4, 3, 8) == 1
    assert inflight_microbatches("1f1b", 4, 0, 2) == 2
    assert inflight_microbatches("none", 1, 0, 1) == 1
    with pytest.raises(ValueError):
        inflight_microbatches("zigzag", 4, 0, 8)
    with pytest.raises(ValueError):
        inflight_microbatches("1f1b", 4, 4, 8)
