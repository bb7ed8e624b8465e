"""Repeated layers are found and tied (``graph/layers.py``): the solver then decides one layer's
layout for all of them, which is what keeps a deep model's problem the size of one layer."""
import torch
import torch.nn as nn

from autopar.graph.layers import find_layers, tie_groups
from autopar.frontend.trace import trace
from examples.models import GPT, Llama


def _layers(model, x):
    traced = trace(model, (x,))
    names = {**traced.params, **traced.buffers}
    return find_layers(traced.gm, names)


def _tied(layers) -> int:
    """How many layers the largest tie group spans."""
    return max((len(g) for g in tie_groups(layers)), default=1)


def test_llama_layers_with_rotary_cat_are_tied():
    """``cat((-x2, x1))`` passes its tensors in a list; their names differ per layer, their shapes do not."""
    model = Llama(vocab=64, hidden=32, heads=4, layers=3, seq=8, ffn=64)
    layers = _layers(model, torch.randint(0, 64, (2, 8)))
    assert [layer.index for layer in layers] == [0, 1, 2]
    assert len({layer.signature for layer in layers}) == 1
    assert _tied(layers) == 3


def test_gpt_layers_are_tied():
    layers = _layers(GPT(vocab=64, hidden=32, heads=4, layers=3, seq=8), torch.randint(0, 64, (2, 8)))
    assert len({layer.signature for layer in layers}) == 1 and _tied(layers) == 3


class _Split(nn.Module):
    def __init__(self, parts: int):
        super().__init__()
        self.fc, self.parts = nn.Linear(8, 8), parts

    def forward(self, x):
        return self.fc(x).view(-1, self.parts, 8 // self.parts).sum(1)


class _Uneven(nn.Module):
    """Two layers of one container that differ only in an argument (the split of a view)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Split(2), _Split(4)])

    def forward(self, x):
        return sum(layer(x).sum() for layer in self.layers)


def test_layers_that_differ_are_not_tied():
    layers = _layers(_Uneven(), torch.randn(2, 8))
    assert len(layers) == 2 and layers[0].signature != layers[1].signature
    assert tie_groups(layers) == []
