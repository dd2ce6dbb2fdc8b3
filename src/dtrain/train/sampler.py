"""Sharding a dataset across data-parallel ranks, one disjoint slice per rank per epoch.

All ranks draw the same permutation (a shared seed plus the epoch number), then rank r
takes every `num_replicas`-th index starting at r. Across ranks every sample is seen once
per epoch; when the dataset does not divide evenly, `drop_last=True` drops the tail and
`drop_last=False` pads with the first indices again so every rank gets the same count
(ranks that took different numbers of steps would deadlock in their collectives).
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch
from torch.utils.data import Sampler

from dtrain.errors import DtrainError


class ShardedSampler(Sampler[int]):
    """Yield this rank's indices of a dataset for the current epoch.

    Args:
        dataset: anything with `len()`.
        num_replicas: number of data-parallel ranks.
        rank: this rank's index among them.
        shuffle: draw a fresh permutation each epoch (same on every rank).
        seed: base seed shared by all ranks.
        drop_last: drop the tail that does not divide evenly instead of padding.

    Call `set_epoch(e)` at the start of every epoch so each epoch is shuffled differently.

    Raises:
        DtrainError: rank outside [0, num_replicas), or too few samples to give every rank one.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise DtrainError(f"rank {rank} is outside [0, {num_replicas})")
        self.total = len(dataset)
        if drop_last and self.total < num_replicas:
            raise DtrainError(
                f"{self.total} samples cannot give each of {num_replicas} ranks one with "
                "drop_last: use more data or fewer ranks"
            )
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        if drop_last:
            self.per_rank = self.total // num_replicas
        else:
            self.per_rank = -(-self.total // num_replicas)

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of `epoch` (identical on every rank)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.per_rank

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.total, generator=generator).tolist()
        else:
            order = list(range(self.total))
        needed = self.per_rank * self.num_replicas
        while len(order) < needed:
            order += order[: needed - len(order)]
        return iter(order[self.rank : needed : self.num_replicas])
