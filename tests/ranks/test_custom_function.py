"""User autograd Functions stay opaque: every plan trains with the Function's OWN backward,
exactly like one process (issue 11, case 5). SGD with momentum, so a gradient-scale error shows."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.frontend.opaque_functions import opaque_functions
from autopar.frontend.trace import trace
from conftest import run_ranks
from oracle import assert_same_training, make_batch, parallel_run, reference_run
from semantics_models import StraightThroughRound


class MatmulGradScale(torch.autograd.Function):
    """x @ w.T whose backward scales both gradients by ``scale`` (a non-tensor argument)."""

    @staticmethod
    def forward(ctx, x, w, scale):
        ctx.save_for_backward(x, w)
        ctx.scale = scale
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g * ctx.scale
        return g @ w, g.t() @ x, None


class SplitRound(torch.autograd.Function):
    """Two outputs (integer part, remainder); the remainder's gradient passes at half weight."""

    @staticmethod
    def forward(ctx, x):
        r = torch.round(x)
        return r, x - r

    @staticmethod
    def backward(ctx, g_int, g_rem):
        return g_int + 0.5 * g_rem


class Quantized(nn.Module):
    def __init__(self, d_in=16, hidden=32, classes=10):
        super().__init__()
        self.inp = nn.Linear(d_in, hidden)
        self.w = nn.Parameter(torch.randn(hidden, hidden) / hidden ** 0.5)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x):
        h = StraightThroughRound.apply(torch.tanh(self.inp(x)))
        h = MatmulGradScale.apply(h, self.w, 0.5)
        whole, rem = SplitRound.apply(h * 3)
        return self.out(whole + 2 * rem)


def _batch():
    return make_batch("vector", 8, d_in=16)


def _job(rank, mesh, mode):
    x, y = _batch()
    return parallel_run(rank, Quantized, F.cross_entropy, x, y, mesh, mode, optim="sgd", lr=0.1)


def _reference():
    x, y = _batch()
    return reference_run(Quantized, F.cross_entropy, x, y, optim="sgd", lr=0.1)


def test_stand_alone_uses_the_functions_own_backward():
    result = _job(0, autopar.Mesh(1), "stand_alone")
    assert_same_training(_reference(), result, what="stand_alone")


@pytest.mark.parametrize("mode, n, device", [("data", 2, "cpu"), ("data", 4, "cpu"), ("auto", 2, "a100-80gb")])
def test_ranks_train_like_one_process(mode, n, device):
    """``w`` lives on the root module and is used only by a replicated Function: its gradient
    must not be summed over the data-parallel ranks (DDP's reducer spells it ``.w``)."""
    ref = _reference()
    for r in run_ranks(n, _job, autopar.Mesh(n, device=device), mode):
        assert_same_training(ref, r, what=f"{mode} on {n} ranks")
        if mode == "data":
            assert r["degrees"]["dp"] == n


def test_function_is_one_replicated_node():
    x, y = _batch()
    plan = autopar.plan(Quantized(), autopar.Mesh(2), example_inputs=(x,), loss_fn=F.cross_entropy,
                        example_target=y, mode="data")
    ops = [d for d in plan.nodes.values() if d.op == "autopar.autograd_function.default"]
    assert len(ops) == 3
    assert all({str(s) for s in d.inputs} == {"[R]"} and {str(s) for s in d.output} == {"[R]"} for d in ops), [(d.inputs, d.output) for d in ops]
    assert not any("round" in d.op for d in plan.nodes.values())


class NoisyMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        mask = (torch.rand_like(x) > 0.5).to(x.dtype)
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        return g * mask * 3


def test_backward_recomputes_under_the_forwards_rng_state():
    x = torch.randn(64, 8)

    def grad_and_next_draw():
        torch.manual_seed(3)
        leaf = x.clone().requires_grad_()
        NoisyMask.apply(leaf).sum().backward()
        return leaf.grad, torch.rand(1)

    want = grad_and_next_draw()
    with opaque_functions():
        got = grad_and_next_draw()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_retrace_at_another_batch_reuses_the_function_key():
    model = Quantized()
    keys = []
    for batch in (8, 4):
        t = trace(model, (torch.randn(batch, 16),))
        keys.append([n.args[0] for n in t.gm.graph.nodes if n.target == torch.ops.autopar.autograd_function.default])
    assert keys[0] == keys[1] and len(set(keys[0])) == 3


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_torch_internal_functions_are_not_intercepted():
    from torch.utils.checkpoint import CheckpointFunction

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return CheckpointFunction.apply(self.lin, False, x)

    t = trace(M(), (torch.randn(2, 4),))
    assert not any(n.target == torch.ops.autopar.autograd_function.default for n in t.gm.graph.nodes)


class ReturnsCount(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2, 3

    @staticmethod
    def backward(ctx, g, _):
        return g


class TakesModule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lin):
        return lin(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


class InPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, g):
        return g * 2


class Captures(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, holder):
        return x @ holder.weight.t()

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Calls(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if self.fn is TakesModule:
            return TakesModule.apply(h, self.lin)
        if self.fn is Captures:
            return Captures.apply(h, SimpleNamespace(weight=self.lin.weight))
        out = self.fn.apply(h)
        return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("fn, says", [
    (ReturnsCount, "returns int, so autopar cannot keep it opaque (its outputs must all be tensors)"),
    (TakesModule, "gets the module Linear as an argument, so autopar cannot keep it opaque"),
    (InPlace, "modifies an input in place, so autopar cannot keep it opaque"),
    (Captures, "uses a model tensor that is not an argument of apply"),
])
def test_functions_that_cannot_stay_opaque_are_refused(fn, says):
    with pytest.raises(autopar.TraceError) as err:
        trace(_Calls(fn), (torch.randn(2, 4),))
    msg = str(err.value)
    assert f"autograd Function {__name__}.{fn.__qualname__}" in msg and says in msg, msg
