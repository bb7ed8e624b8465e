"""Which plans the search re-plans with recomputation around the attention core (``solver/attention_kept.py``):
the fastest plan of each candidate that recomputes a layer "full", at most ``LIMIT``; the attention cores'
share of a plan's op time, the estimate that lets a slower candidate be probed."""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from autopar.solver import attention_kept
from autopar.solver.attention_kept import LIMIT, MIN_GAIN, attention_cores, core_share, kept_probes, worth_probing
from autopar.frontend.trace import trace
from examples.models import GPT, lm_loss
from oracle import make_batch


def _plan(shape, step, recompute="full", pipeline=False, candidate="", core=0.3):
    mesh = NS(shape=shape, axis_names=tuple(f"a{i}" for i in range(len(shape))))
    return NS(mesh=mesh, step_time=step, pipeline=object() if pipeline else None, candidate=candidate,
              memory_options=NS(recompute=recompute), nodes={"sdpa": NS(time=core), "mm": NS(time=1 - core)})


def _rank(p):
    return (False, p.step_time)


def test_the_fastest_plan_of_each_candidate_that_recomputes_full():
    a1, a2 = _plan((8, 2), 1.0), _plan((8, 2), 0.9)                  # one candidate: its faster plan
    b = _plan((4, 4), 1.1, {"blocks.0": "full", "blocks.1": "none"})   # a partial plan counts
    c = _plan((2, 8), 1.2, "selective")                                 # nothing recomputed "full"
    d = _plan((16,), 0.8, "full", candidate="DDP layout")               # DDP's layout is not re-planned
    e = _plan((8, 2), 1.3, pipeline=True)                               # a pipeline on the same mesh is its own
    assert worth_probing([a1, b, c, d, a2, e], _rank, frozenset({"sdpa"})) == [a2, b, e]
    many = [_plan((i, 1), 1.0 + i) for i in range(1, 6)]
    assert len(worth_probing(many, _rank, frozenset({"sdpa"}))) == LIMIT
    assert worth_probing(many, _rank, frozenset()) == []               # no attention core: nothing to keep


def test_core_share_and_the_cores_of_a_gpt():
    x, y = make_batch("tokens", 4)
    gm = trace(GPT(layers=2, hidden=32), (x,), lm_loss, y).gm
    cores = attention_cores(gm)
    assert sum("scaled_dot_product" in str(n.target) for n in gm.graph.nodes if n.name in cores) == 2
    plan = NS(nodes={"sdpa": NS(time=1.0), "linear": NS(time=3.0)})
    assert core_share(plan, frozenset({"sdpa"})) == pytest.approx(0.25)
    assert core_share(NS(nodes={}), frozenset({"sdpa"})) == 0.0


def test_probes_where_the_estimate_pays(monkeypatch):
    """The best plan is probed with its bisection; another only while step x (1 - c/3) beats the best, without
    it; none whose estimate gains under ``MIN_GAIN`` of its step."""
    calls = []
    monkeypatch.setattr(attention_kept, "kept_plans", lambda req, p, traces, cands, bisect: calls.append((p, bisect)) or [])
    monkeypatch.setattr(attention_kept, "attention_cores", lambda gm: frozenset({"sdpa"}))
    req = NS(traced=NS(gm=None), opts=NS(progress=None))
    best, close, far = _plan((8, 2), 1.0), _plan((4, 4), 1.05), _plan((2, 8), 1.2)   # c = 0.3: gain 0.1
    kept_probes(req, [far, best, close], {}, None, _rank)
    assert calls == [(best, True), (close, False)]
    calls.clear()
    tiny = 3 * MIN_GAIN * 0.9
    kept_probes(req, [_plan((8, 2), 1.0, core=tiny)], {}, None, _rank)
    assert calls == []
    kept_probes(req, [_plan((8, 2), 1.0, recompute="selective")], {}, None, _rank)
    assert calls == []
