"""Feeding data: a DistributedSampler that can resume mid-epoch from a checkpoint, and a loader that starts over when
it ends (what a pipeline's ``train_batch`` reads from)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional

from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler
from torch.utils.data.distributed import DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    """Counts the indices it has handed out in the current epoch so a checkpoint can record the position.

    After ``load_state_dict`` the next iteration of the saved epoch skips what was already consumed
    (rescaled when the number of ranks changed: every rank takes every world-th index of the same
    shuffled order). Calling ``set_epoch`` with another epoch drops the pending skip.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.consumed = 0
        self._skip = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._skip = 0
        super().set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        skip, self._skip = self._skip, 0
        self.consumed = skip
        for position, index in enumerate(super().__iter__()):
            if position < skip:
                continue
            self.consumed = position + 1
            yield index

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "num_replicas": self.num_replicas}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self._skip = state["consumed"] * state["num_replicas"] // self.num_replicas
        self.consumed = self._skip


class RepeatingLoader:
    """Iterate ``loader`` forever: when one pass ends, the next starts (DeepSpeed's ``RepeatingLoader``; a pipeline
    engine pulls ``gradient_accumulation_steps`` micro-batches per ``train_batch`` whatever the epoch length)."""

    def __init__(self, loader: Iterable):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> "RepeatingLoader":
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)  # an empty loader ends here, as one pass of it would


def distributed_loader(
    dataset: Dataset,
    batch_size: int,
    replicas: int,
    rank: int,
    *,
    shuffle: bool,
    drop_last: bool,
    collate_fn: Optional[Callable] = None,
    sampler: Optional[Sampler] = None,
    pin_memory: bool = False,
    num_workers: int = 0,
) -> DataLoader:
    """This rank's loader of ``dataset``: its share of every epoch (``replicas`` ranks see different samples) through
    the resumable sampler, shuffled or in order, unless the client gives a ``sampler`` of its own (or the dataset is
    iterable: it shards itself)."""
    if sampler is None and not isinstance(dataset, IterableDataset):
        sampler = ResumableDistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=shuffle)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=drop_last,
        pin_memory=pin_memory,
        num_workers=num_workers,
    )
