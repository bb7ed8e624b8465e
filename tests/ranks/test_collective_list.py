"""The plan's collective list is what one training step runs, per rank (issue 12, check 2).

Each job plans, runs one warm-up step, then counts one step with ``count_collectives()`` and
compares it with ``plan.collectives(rank)``. How the two lists are compared:

* Every collective is keyed by ``(kind, axis, phase)``; a plan entry over several axes counts
  once per axis (the runtime sums over one axis at a time).
* **Bytes**: the total bytes per key must be equal — gradient sync included.
* **Count**: the multiset of keys must be equal, *except for gradient sync* (the sums of
  parameter gradients after backward: DDP's buckets, the post-accumulate hooks, the flat
  per-axis sums and the tied-embedding sums of a pipeline). The plan lists gradient sync as one
  all-reduce per parameter and axis; the runtime packs many parameters into one DDP bucket or
  one flat buffer, so how many calls run depends on the bucket size, not on the plan. Gradient
  sync is compared by bytes only (summed per axis). On the runtime side, it is what
  ``runtime/grad_sync.py`` (DDP's hook, the hooks, the flat sums) and ``pipeline_module.py``
  (tied-embedding sums) record; on the plan side, the entries whose node is a parameter
  placeholder. A runtime call over a flattened group of several axes (label ``"a+b"``) counts
  once per axis, as a plan entry over several axes does.
* Bytes are a collective's full size (an all-gather's output), as ``step_bytes`` lists them.
* A pipeline plan lists one microbatch's activation collectives: each is counted once per
  microbatch, the sends and receives of activations and their gradients between stages
  included. The tied-embedding sum over "pp" is gradient sync (its node is the placeholder).
"""
from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import autopar
import autopar.modules.pipeline_module
import autopar.runtime.grad_sync
import autopar.runtime.zero
import autopar.runtime.zero3
from conftest import run_ranks
from examples.models import CNN, GPT, MLP, lm_loss
from oracle import make_batch

SMALL_GPT = functools.partial(GPT, qkv_bias=False, layers=2, hidden=32)
SYNC_LABELS = ("dp", "grad")


class _MarkSync:
    """Stands in for ``COUNTER`` in the modules that sum gradients after backward
    (``runtime/grad_sync.py``, ``pipeline_module.py``): marks the calls they record."""

    def __init__(self, counter, marks: set):
        self.counter, self.marks = counter, marks

    def record(self, kind, t, axis, phase):
        if self.counter.enabled:
            self.marks.add(len(self.counter.calls))
        self.counter.record(kind, t, axis, phase)


def _job(rank, kind):
    torch.manual_seed(0)
    if kind == "mlp":
        x, y = make_batch("vector", 8)
        model, loss_fn, mesh, mode = MLP(), F.cross_entropy, autopar.Mesh(4), "auto"
    elif kind == "cnn":     # synced batch norm: 2 all-reduces forward, 2 backward per BatchNorm
        x, y = make_batch("image", 8)
        model, loss_fn, mesh, mode = CNN(), F.cross_entropy, autopar.Mesh(4), "data"
    else:
        x, y = make_batch("tokens", 8)
        model, loss_fn = SMALL_GPT(), lm_loss
        if kind == "data":
            mesh, mode = autopar.Mesh(4), "auto"
        elif kind == "accumulation":     # 2 microbatches one after another on a (dp, tp) plan: the sync runs once
            autopar.set_auto_parallel_context(accumulation=2)
            mesh, mode = autopar.Mesh((2, 2), axis_names=("dp", "tp")), "semi_auto"
            autopar.shard("blocks.*.fc1", weight={"tp": autopar.Shard(0)})
            autopar.shard("blocks.*.fc2", weight={"tp": autopar.Shard(1)})
        elif kind in ("tp_semi", "tp_auto"):
            mesh, mode = autopar.Mesh(2, axis_names=("tp",), device="a100-80gb"), kind.replace("tp_", "")
            if kind == "tp_semi":
                mode = "semi_auto"
                autopar.shard({f"blocks.*.{n}": ColwiseParallel() for n in ("fc1",)}
                              | {f"blocks.*.{n}": RowwiseParallel() for n in ("proj", "fc2")}, axis="tp")
                autopar.shard("blocks.*.qkv", weight={"tp": autopar.Shard(0, 3)})
            else:
                probe = autopar.plan(SMALL_GPT(), mesh, example_inputs=(x,), loss_fn=loss_fn, example_target=y,
                                     mode="stand_alone")
                cap = 0.66 * max(probe.memory_per_device) / 2 ** 30
                # splitting weights (no other lever) must fit: at 0.7 halving the activations over the batch fits
                autopar.set_auto_parallel_context(recompute="none", accumulation=1, zero=0)
                mesh = autopar.Mesh(2, axis_names=("tp",), device="a100-80gb", memory_gb=cap)
        elif kind == "pp":
            autopar.set_auto_parallel_context(schedule="1f1b", microbatches=2)
            mesh, mode = autopar.Mesh(2, axis_names=("pp",)), "auto"
        elif kind == "interleaved":     # 4 stages on 2 ranks: each rank holds two
            model = GPT(qkv_bias=False, layers=4, hidden=32)
            autopar.set_auto_parallel_context(schedule="interleaved_1f1b", microbatches=2)
            mesh, mode = autopar.Mesh(2, axis_names=("pp",)), "auto"
        else:
            autopar.set_auto_parallel_context(schedule="1f1b", microbatches=2)
            mesh, mode = autopar.Mesh((2, 2, 2), axis_names=("pp", "dp", "tp")), "auto"
    pmodel = autopar.parallelize(model, mesh, example_inputs=(x,), loss_fn=loss_fn, example_target=y, mode=mode)
    pmodel.step(x, target=y)
    for p in pmodel.parameters():
        p.grad = None
    synced: set = set()
    mods = [autopar.runtime.grad_sync, autopar.modules.pipeline_module, autopar.runtime.zero,   # ZeRO: the reduce-scatter is the sync
            autopar.runtime.zero3]
    with autopar.count_collectives() as counter:
        for m in mods:
            m.COUNTER = _MarkSync(counter, synced)
        try:
            pmodel.step(x, target=y)
        finally:
            for m in mods:
                m.COUNTER = counter
    plan = pmodel.plan
    placeholders = {d.placeholder for d in plan.params.values()}
    names = plan.mesh.axis_names
    ran = []
    for i, (k, nbytes, ax, ph) in enumerate(counter.calls):
        sync = i in synced
        assert ax not in SYNC_LABELS or ax in names, f"gradient sync over an unnamed group: {ax}"
        ran += [(k, nbytes, a, ph, sync) for a in ax.split("+")]
    # a pipeline (accumulation) plan lists one microbatch's activation collectives: each runs once per microbatch
    # ZeRO-1/2's weight all-gather (phase "step") runs in opt.step, which this job does not call
    planned = [(c.kind, c.bytes, a, c.phase, c.node in placeholders)
               for c in plan.collectives(rank) if c.phase != "step"
               for a in c.axes for _ in range(plan.runs_per_step(c))]
    return {"ran": ran, "planned": planned, "degrees": plan.degrees,
            "params": {k: str(v.spec) for k, v in plan.params.items()}, "stages": len(plan.stages),
            "accumulation": plan.memory_options.accumulation}


def _compare(results, what):
    for rank, r in enumerate(results):
        def counts(xs):
            return Counter((k, a, ph) for k, _, a, ph, sync in xs if not sync)

        def nbytes(xs):
            out = Counter()
            for k, b, a, ph, _ in xs:
                out[(k, a, ph)] += b
            return out
        assert counts(r["planned"]) == counts(r["ran"]), (
            f"{what} rank {rank}: collectives (not gradient sync) planned {sorted(counts(r['planned']).items())} "
            f"ran {sorted(counts(r['ran']).items())}")
        assert nbytes(r["planned"]) == nbytes(r["ran"]), (
            f"{what} rank {rank}: bytes planned {sorted(nbytes(r['planned']).items())} "
            f"ran {sorted(nbytes(r['ran']).items())}")


def test_data_parallel_list_is_what_runs():
    for kind in ("mlp", "cnn", "data"):
        _compare(run_ranks(4, _job, kind), kind)


def test_tensor_parallel_list_is_what_runs():
    for kind in ("tp_semi", "tp_auto"):
        results = run_ranks(2, _job, kind)
        _compare(results, kind)
    assert any("S(" in s for s in results[0]["params"].values())


def test_accumulation_list_is_what_runs():
    results = run_ranks(4, _job, "accumulation")
    assert results[0]["params"]["blocks.0.fc1.weight"] == "[R,S(0)]"
    assert results[0]["accumulation"] == 2
    _compare(results, "accumulation")


@pytest.mark.slow  # 8 ranks; 3-D training itself is in the default run (test_feature_matrix, test_pipeline)
def test_3d_list_is_what_runs():
    results = run_ranks(8, _job, "3d")
    assert results[0]["degrees"]["pp"] == 2
    _compare(results, "3d")


def test_interleaved_list_is_what_runs():
    """Each rank holds two of the four stages: it lists the transfers of both."""
    results = run_ranks(2, _job, "interleaved")
    assert results[0]["stages"] == 4
    _compare(results, "interleaved")


def test_pipeline_list_is_what_runs():
    """Sends/receives and tied sums are listed per rank: the first stage sends activations forward and receives their gradients; the last the
    reverse; both sum the tied embedding's gradient over "pp" (gradient sync)."""
    first, last = run_ranks(2, _job, "pp")

    def keys(r):
        return {(k, a, ph, sync) for k, _, a, ph, sync in r["planned"] if a == "pp"}
    assert keys(first) == {("send", "pp", "fwd", False), ("recv", "pp", "bwd", False), ("all_reduce", "pp", "bwd", True)}
    assert keys(last) == {("recv", "pp", "fwd", False), ("send", "pp", "bwd", False), ("all_reduce", "pp", "bwd", True)}
    _compare([first, last], "pp")
