"""ShardedSampler: disjoint shards, every sample once per epoch, same order on every rank."""

from __future__ import annotations

import pytest

from dtrain import ShardedSampler
from dtrain.errors import DtrainError


@pytest.mark.parametrize("n, replicas", [(10, 2), (10, 3), (7, 4), (1, 1)])
def test_every_sample_once_per_epoch(n: int, replicas: int) -> None:
    data = range(n)
    shards = [list(ShardedSampler(data, replicas, r, seed=3)) for r in range(replicas)]
    assert len({len(s) for s in shards}) == 1  # equal counts: no rank waits on another
    seen = [i for s in shards for i in s]
    assert set(seen) == set(range(n))
    assert len(seen) - n < replicas  # padding repeats fewer than one sample per rank


def test_drop_last_gives_disjoint_equal_shards() -> None:
    shards = [list(ShardedSampler(range(10), 3, r, drop_last=True)) for r in range(3)]
    flat = [i for s in shards for i in s]
    assert [len(s) for s in shards] == [3, 3, 3] and len(set(flat)) == 9


def test_epochs_reshuffle_identically_on_all_ranks() -> None:
    a, b = ShardedSampler(range(100), 2, 0, seed=1), ShardedSampler(range(100), 2, 1, seed=1)
    first = (list(a), list(b))
    a.set_epoch(1)
    b.set_epoch(1)
    second = (list(a), list(b))
    assert first != second
    assert set(second[0]).isdisjoint(second[1]) and set(first[0]).isdisjoint(first[1])


def test_no_shuffle_is_strided() -> None:
    assert list(ShardedSampler(range(6), 2, 1, shuffle=False)) == [1, 3, 5]


def test_bad_rank_is_an_error() -> None:
    with pytest.raises(DtrainError, match="rank 2 is outside"):
        ShardedSampler(range(4), 2, 2)
