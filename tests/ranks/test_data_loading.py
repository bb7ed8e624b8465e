"""Feeding a ParallelModule from a Dataset (autopar/runtime/data.py): under a dp 2 x tp 2 plan on 4 ranks,
a pp 2 x dp 2 pipeline (2 microbatches) and a 2-rank DATA plan run as 2 accumulation chunks, each rank
loads its part of every global batch through ``DataParallelSampler`` and ``pmodel.step(x, target=y,
local_batch=True)`` trains like one process on the same global batches; tensor and pipeline peers
load the same samples. A stopped sampler's state resumes the same remaining sequence
(``DataParallelLoader`` counts exactly with worker processes); bad datasets, batch sizes and states
are refused clearly. (The pipeline job also checks that LBFGS, which needs every parameter on every
rank, is refused under a pipeline.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import autopar
from conftest import run_ranks
from examples.models import MLP
from oracle import assert_same_training

STEPS, SEED = 3, 3


def _dataset(n: int = 200):
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g))


def _reference(batch: int):
    """One process on the sampler's global batches: ``global_order`` of epoch 0, cut into batches."""
    data = _dataset()
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(SEED)).tolist()
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    out = {"losses": [], "grads": [], "params": []}
    for j in range(STEPS):
        x, y = data[order[j * batch:(j + 1) * batch]]
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        out["losses"].append(float(loss.detach()))
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        out["params"].append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def _job(rank, kind: str, batch: int):
    x0, y0 = _dataset()[:batch]
    torch.manual_seed(0)
    model = MLP()
    if kind == "dp_tp":
        autopar.shard({"layers.0": ColwiseParallel(), "layers.1": RowwiseParallel()}, axis="tp")
        mesh = autopar.Mesh((2, 2), axis_names=("dp", "tp"), device="a100-80gb")
    elif kind == "accumulation":
        autopar.set_auto_parallel_context(accumulation=2)
        mesh = autopar.Mesh(2, axis_names=("dp",))
    else:
        autopar.set_auto_parallel_context(schedule="gpipe", microbatches=2)
        autopar.pipeline_stage(model.layers[1], 1)
        mesh = autopar.Mesh((2, 2), axis_names=("pp", "dp"))
    pmodel = autopar.parallelize(model, mesh, example_inputs=(x0,), loss_fn=F.cross_entropy, example_target=y0,
                                 mode="semi_auto")
    sampler = autopar.DataParallelSampler(_dataset(), pmodel, shuffle=True, seed=SEED)
    loader = DataLoader(_dataset(), batch_sampler=sampler)
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.05, momentum=0.9)
    out = {"losses": [], "grads": [], "params": [], "indices": [], "degrees": pmodel.plan.degrees,
           "microbatches": max(pmodel.plan.microbatches, pmodel.plan.memory_options.accumulation), "dp": (pmodel.data_parallel_rank, pmodel.data_parallel_size)}
    for j, (x, y) in enumerate(loader):
        if j == STEPS:
            break
        out["losses"].append(float(pmodel.step(x, target=y, local_batch=True)))
        out["grads"].append(pmodel.full_grad_dict())
        opt.step()
        opt.zero_grad()
        out["params"].append(pmodel.full_state_dict())
    out["indices"] = list(iter(autopar.DataParallelSampler(_dataset(), pmodel, shuffle=True, seed=SEED)))[:STEPS]
    if kind == "pipeline":
        lbfgs = torch.optim.LBFGS(pmodel.parameters())
        try:
            lbfgs.step(lambda: pmodel.step(x0, target=y0))
        except TypeError as err:
            out["lbfgs"] = str(err)
    return out


@pytest.mark.parametrize("kind,batch,degrees,microbatches", [("dp_tp", 64, {"dp": 2, "tp": 2, "pp": 1, "ep": 1, "cp": 1}, 1),
                                                             ("pipeline", 16, {"dp": 2, "tp": 1, "pp": 2, "ep": 1, "cp": 1}, 2),
                                                             ("accumulation", 16, {"dp": 2, "tp": 1, "pp": 1, "ep": 1, "cp": 1}, 2)])
def test_sampled_local_batches_train_like_one_process_on_the_global_batches(kind, batch, degrees, microbatches):
    """(At 16 samples the (dp, tp) plan leaves dp unused: it trains on 64.) ``microbatches``: the pipeline's,
    or the plan's accumulation chunks."""
    results = run_ranks(2 if kind == "accumulation" else 4, _job, kind, batch)
    ref = _reference(batch)
    for r, res in enumerate(results):
        assert res["degrees"] == degrees and res["microbatches"] == microbatches, res["degrees"]
        assert_same_training(ref, res, what=f"{kind} rank {r}")
    by_dp = {}
    for res in results:
        by_dp.setdefault(res["dp"], []).append(res["indices"])
    assert sorted(by_dp) == [(0, 2), (1, 2)]
    for peers in by_dp.values():
        assert all(p == peers[0] for p in peers), "ranks sharing a data-parallel index must load the same samples"
    order = torch.randperm(200, generator=torch.Generator().manual_seed(SEED)).tolist()
    for j in range(STEPS):
        both = by_dp[(0, 2)][0][j] + by_dp[(1, 2)][0][j]
        assert len(both) == batch and sorted(both) == sorted(order[j * batch:(j + 1) * batch])
    if kind == "pipeline":
        assert results[0]["lbfgs"].startswith("torch.optim.LBFGS cannot train under this plan: its line search takes "
                                              "dot products over every parameter of the model at once, but this rank "
                                              "holds only its pipeline stage's parameters"), results[0]["lbfgs"]


class _Layout:
    """Stands for a ParallelModule's batch layout (what the sampler reads), for index-only tests."""

    def __init__(self, batch: int, dp_rank: int = 0, dp_size: int = 1):
        self.global_batch_size, self.data_parallel_rank, self.data_parallel_size = batch, dp_rank, dp_size

    def local_batch_rows(self):
        n = self.global_batch_size // self.data_parallel_size
        return list(range(self.data_parallel_rank * n, (self.data_parallel_rank + 1) * n))


@pytest.fixture(scope="module")
def one_device():
    """A real ParallelModule on one device (global batch 4) and a dataset of 10 samples."""
    torch.manual_seed(0)
    data = _dataset(10)
    x, y = data[:4]
    return autopar.parallelize(MLP(), autopar.Mesh(1), example_inputs=(x,), loss_fn=F.cross_entropy,
                               example_target=y), data


def test_a_resumed_sampler_yields_the_remaining_batches(one_device):
    pmodel, data = one_device
    first = autopar.DataParallelSampler(data, pmodel, seed=1)
    whole = [b for _ in range(3) for b in first]               # three epochs, two batches each
    assert len(whole) == 6 and whole[:2] != whole[2:4], "every epoch has its own order"
    stopped = autopar.DataParallelSampler(data, pmodel, seed=1)
    loader = DataLoader(data, batch_sampler=stopped)
    seen = []
    for epoch in range(2):
        stopped.set_epoch(epoch)
        for j, (x, _) in enumerate(loader):
            seen.append(x)
            if epoch == 1 and j == 0:
                break
    state = stopped.state_dict()
    assert (state["epoch"], state["position"]) == (1, 1)
    resumed = autopar.DataParallelSampler(data, pmodel, seed=1)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)                     # the loop's own set_epoch keeps the position
    assert len(resumed) == 1
    rest = [b for _ in range(2) for b in resumed]
    assert rest == whole[3:]
    for x, idx in zip(seen, whole):
        assert torch.equal(x, data[idx][0])


def test_the_loader_counts_batches_given_to_the_loop_with_workers_fetching_ahead(one_device):
    pmodel, data = one_device
    whole = list(autopar.DataParallelSampler(data, pmodel, seed=1))
    loader = autopar.DataParallelLoader(data, pmodel, seed=1, num_workers=2)
    got = next(iter(loader))
    assert torch.equal(got[0], data[whole[0]][0])
    assert loader.state_dict()["position"] == 1, "workers fetched ahead, but the loop took one batch"
    again = autopar.DataParallelLoader(data, pmodel, seed=1)
    again.load_state_dict(loader.state_dict())
    assert [torch.equal(x, data[i][0]) for (x, _), i in zip(again, whole[1:])] == [True]


def test_ranks_split_each_global_batch_and_the_last_one_is_filled_without_drop_last():
    data = _dataset(10)
    ranks = [autopar.DataParallelSampler(data, _Layout(4, r, 2), shuffle=False, drop_last=False) for r in range(2)]
    assert [list(s) for s in ranks] == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [0, 1]]]
    assert [len(list(s)) for s in (autopar.DataParallelSampler(data, _Layout(4), shuffle=False),)] == [2]


def test_state_resumes_under_another_data_parallel_size():
    """The position counts global batches: a run may resume under a plan with another dp size."""
    data = _dataset(40)
    two = [autopar.DataParallelSampler(data, _Layout(8, r, 2), seed=4) for r in range(2)]
    whole = list(autopar.DataParallelSampler(data, _Layout(8), seed=4))
    for s in two:
        next(iter(s))
    four = [autopar.DataParallelSampler(data, _Layout(8, r, 4), seed=4) for r in range(4)]
    for s in four:
        s.load_state_dict(two[0].state_dict())
    parts = [list(s) for s in four]
    assert [sum((p[j] for p in parts), []) for j in range(len(parts[0]))] == whole[1:]


@pytest.mark.parametrize("dataset,kwargs,error,message", [
    (_dataset(3), {}, ValueError,
     r"the dataset has 3 samples, fewer than one global batch of 4 \(the batch the plan was made for\), so with "
     r"drop_last=True no batch would run: use more data, drop_last=False"),
    (_dataset(0), {"drop_last": False}, ValueError, r"the dataset is empty"),
    (_dataset(10), {"batch_size": 6}, ValueError,
     r"batch_size=6 but the plan was made for a global batch of 4 rows \(a sampler cannot change it\)"),
    ("iterable", {}, TypeError, r"DataParallelSampler needs a map-style dataset \(with __len__ and __getitem__\), "
                                r"got a _Stream; shard an iterable dataset yourself by pmodel.data_parallel_rank"),
    (_dataset(10), {"pmodel": object()}, TypeError,
     r"pmodel must be the module autopar.parallelize returned, got a object"),
])
def test_bad_datasets_and_batch_sizes_are_refused_clearly(one_device, dataset, kwargs, error, message):
    pmodel, _ = one_device
    if dataset == "iterable":
        dataset = _Stream()
    kwargs = {"pmodel": pmodel, **kwargs}
    with pytest.raises(error, match=message):
        autopar.DataParallelSampler(dataset, **kwargs)


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


@pytest.mark.parametrize("change,message", [
    ({"seed": 7}, r"the saved sampler state was made with seed 7 \(this sampler: 1\): its position counts batches "
                  r"of another order; build the sampler like the saved one"),
    ({"dataset_len": 12}, r"made with dataset_len 12 \(this sampler: 10\)"),
    ({"position": 5}, r"position 5 is outside an epoch of 2 batches"),
    ({"epoch": None}, r"not a DataParallelSampler state: it lacks epoch"),
])
def test_a_state_from_another_sampler_is_refused_clearly(one_device, change, message):
    pmodel, data = one_device
    sampler = autopar.DataParallelSampler(data, pmodel, seed=1)
    state = {**sampler.state_dict(), **change}
    state = {k: v for k, v in state.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        autopar.DataParallelSampler(data, pmodel, seed=1).load_state_dict(state)
