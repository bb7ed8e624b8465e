"""Feeding a ParallelModule from a map-style Dataset: each rank loads only its part of every global batch.

An epoch is one order of the dataset's indices (a permutation seeded by ``seed + epoch`` when
shuffling, the same on every rank), cut into global batches of the size the plan was made for.
Rank r takes the rows ``pmodel.local_batch_rows()`` of each global batch: its data-parallel piece,
laid out so that the pipeline's microbatches (or the plan's accumulation chunks) cut from it are
the ones the global batch would give. Ranks that share a data-parallel index (tensor and
pipeline peers) get the same indices; ``pmodel.step(x, target=y, local_batch=True)`` trains
exactly as ``pmodel.step`` on the global batch.

The position (epoch, batches done) is a small state dict, so a run stopped mid-epoch resumes
with the remaining batches; it does not depend on the plan, so a run may resume under another
plan or world size with the same global batch. ``DataParallelSampler`` counts the batches it
hands out (exact when the DataLoader has no worker processes); ``DataParallelLoader`` counts
the batches it gives the training loop, exact with workers that fetch ahead too.
"""
from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

_CHECKED = ("seed", "shuffle", "drop_last", "dataset_len", "global_batch")


class DataParallelSampler(Sampler):
    """Batches of dataset indices for this rank: ``DataLoader(dataset, batch_sampler=sampler)``.

    ``shuffle``: a new order every epoch (``seed + epoch``); ``drop_last``: drop the samples that do
    not fill a last global batch (else fill it with the epoch's first indices, as torch's
    DistributedSampler pads). ``batch_size``: the global batch, only checked (the plan fixes it).
    """

    def __init__(self, dataset, pmodel, *, shuffle: bool = True, seed: int = 0, drop_last: bool = True,
                 batch_size: int | None = None):
        for name in ("data_parallel_rank", "data_parallel_size", "global_batch_size", "local_batch_rows"):
            if not hasattr(pmodel, name):
                raise TypeError(f"pmodel must be the module autopar.parallelize returned, got a "
                                f"{type(pmodel).__name__} (it has no {name})")
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise TypeError(f"DataParallelSampler needs a map-style dataset (with __len__ and __getitem__), got a "
                            f"{type(dataset).__name__}; shard an iterable dataset yourself by "
                            "pmodel.data_parallel_rank and pmodel.data_parallel_size")
        self.global_batch = pmodel.global_batch_size
        if batch_size is not None and batch_size != self.global_batch:
            raise ValueError(f"batch_size={batch_size} but the plan was made for a global batch of "
                             f"{self.global_batch} rows (a sampler cannot change it): leave batch_size out, or "
                             f"plan with example inputs of {batch_size} rows")
        self.dataset_len = len(dataset)
        if self.dataset_len == 0:
            raise ValueError("the dataset is empty: DataParallelSampler has nothing to sample")
        if drop_last and self.dataset_len < self.global_batch:
            raise ValueError(f"the dataset has {self.dataset_len} samples, fewer than one global batch of "
                             f"{self.global_batch} (the batch the plan was made for), so with drop_last=True no "
                             "batch would run: use more data, drop_last=False (the last batch is filled with "
                             "samples from the start of the epoch), or plan for a smaller batch")
        self.rows = list(pmodel.local_batch_rows())
        self.data_parallel_rank = pmodel.data_parallel_rank
        self.data_parallel_size = pmodel.data_parallel_size
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.epoch = 0
        self.position = 0          # batches of this epoch already done
        self._counts_yields = True

    @property
    def batches_per_epoch(self) -> int:
        n, b = self.dataset_len, self.global_batch
        return n // b if self.drop_last else math.ceil(n / b)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (its own order when shuffling); the current epoch keeps its position,
        so a loop calling ``set_epoch(e)`` after ``load_state_dict`` resumes mid-epoch. A finished
        epoch moves the sampler on to the next by itself."""
        if int(epoch) != self.epoch:
            self.epoch, self.position = int(epoch), 0

    def __len__(self) -> int:
        """Batches the next pass yields (the epoch's, less those done when resuming)."""
        return self.batches_per_epoch - self.position

    def __iter__(self):
        order = self.global_order(self.epoch)
        b = self.global_batch
        for j in range(self.position, self.batches_per_epoch):
            batch = order[j * b:(j + 1) * b]
            if self._counts_yields:
                self.advance()
            yield [batch[r] for r in self.rows]

    def advance(self) -> None:
        """One batch done: the position moves on (to the next epoch's start after the last batch)."""
        self.position += 1
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0

    def global_order(self, epoch: int) -> list[int]:
        """Every index of ``epoch`` in order (padded to whole global batches when not ``drop_last``)."""
        n = self.dataset_len
        if self.shuffle:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
        else:
            order = list(range(n))
        total = self.batches_per_epoch * self.global_batch
        while len(order) < total:
            order += order[: total - len(order)]
        return order[:total]

    def state_dict(self) -> dict:
        """The position (epoch, batches done) and what it is only valid with (dataset, batch, order)."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "dataset_len": self.dataset_len, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``'s position; refused where the order it counts in would differ."""
        missing = [k for k in ("epoch", "position", *_CHECKED) if k not in state]
        if missing:
            raise ValueError(f"not a DataParallelSampler state: it lacks {', '.join(missing)}")
        mine = self.state_dict()
        differ = [f"{k} {state[k]!r} (this sampler: {mine[k]!r})" for k in _CHECKED if state[k] != mine[k]]
        if differ:
            raise ValueError(f"the saved sampler state was made with {', '.join(differ)}: its position counts "
                             "batches of another order; build the sampler like the saved one")
        if not 0 <= state["position"] <= self.batches_per_epoch:
            raise ValueError(f"position {state['position']} is outside an epoch of {self.batches_per_epoch} batches")
        epoch, position = int(state["epoch"]), int(state["position"])
        self.epoch, self.position = (epoch + 1, 0) if position == self.batches_per_epoch else (epoch, position)


class DataParallelLoader(DataLoader):
    """``DataLoader(dataset, batch_sampler=DataParallelSampler(...), **loader_kwargs)`` whose position
    counts the batches handed to the training loop (worker processes fetch ahead of it)."""

    def __init__(self, dataset, pmodel, *, shuffle: bool = True, seed: int = 0, drop_last: bool = True,
                 batch_size: int | None = None, **loader_kwargs):
        sampler = DataParallelSampler(dataset, pmodel, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                      batch_size=batch_size)
        sampler._counts_yields = False
        super().__init__(dataset, batch_sampler=sampler, **loader_kwargs)

    def __iter__(self):
        sampler = self.batch_sampler
        for batch in super().__iter__():
            sampler.advance()
            yield batch

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)

    def state_dict(self) -> dict:
        return self.batch_sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.batch_sampler.load_state_dict(state)
