"""Training sequences cut from a token stream, the train/held-out split, and the batches.

A token source is anything sliceable with `len`: a tensor or array of ids, `TokenShards`
(memory-mapped shards), or a `View` of either. Nothing here copies a source whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch.utils.data import Dataset

from dtrain.errors import ConfigError


class Tokens(Protocol):
    """A sliceable token source: `len` and `source[a:b]` (ids a..b-1)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: slice) -> torch.Tensor | np.ndarray: ...


IGNORE = -100
"""The target of a position that has no loss (torch's cross-entropy ignore_index)."""


class Sequences(Protocol):
    """A dataset of training rows: `len`, `dataset[i]` (inputs, targets) or (inputs,
    targets, positions), and `targets_in(rows)`: how many positions of those rows are
    targets, None when every position of every row is one; `pairs`: rows 2i and 2i+1 are
    a preference pair's chosen and rejected rows, which `batches` never parts."""

    pairs: bool

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]: ...

    def targets_in(self, rows: list[int]) -> int | None: ...

    def filled_in(self, rows: list[int]) -> int | None:
        """How many positions of `rows` are not padding; None when none is."""


@dataclass
class Batch:
    """Rows of a step's batch, as a rank feeds them to its model.

    Unpacks as `x, y = batch`. With documents packed into rows (dtrain.data.packing),
    `positions` holds each token's place in its document, and with targets that are not
    every position (`IGNORE` in `targets`: loss masks, padding), `targets_in_step` is how
    many positions of the whole global step are targets: the loss is their mean, so a
    rank's share weighs by its own count (`weight`).

    With `pairs` (preference data), the rows are whole preference pairs: row 2i is pair
    i's prompt + chosen response, row 2i+1 its prompt + rejected response (the same
    prompt), their targets the responses' tokens only: `inputs[0::2]` are the chosen
    rows, `inputs[1::2]` the rejected ones.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor | None = None
    targets_in_step: int | None = None
    filled_in_step: int | None = None
    """How many positions of the whole global step are not padding (None: all)."""
    weight: float | None = None
    """This batch's loss (a mean over its own targets) times `weight` is its part of the
    step's mean over all targets (`shared`); None: the plain mean is."""
    pairs: bool = False
    """Rows 2i and 2i+1 are a preference pair's chosen and rejected rows."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        yield self.inputs
        yield self.targets

    def shared(self, shares: int) -> Batch:
        """The batch weighed as one of `shares` whose mean losses are averaged in a step
        (dp x cp x accumulation, over every copy of the model): its targets x shares /
        the step's, set where not every position is a target."""
        if self.targets_in_step is None:
            return self
        mine = int((self.targets != IGNORE).sum())
        return dataclasses.replace(self, weight=mine * shares / max(1, self.targets_in_step))

    def map(self, f: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        """The batch with `f` applied to each tensor (a rank's chunks, a device)."""
        return dataclasses.replace(self, inputs=f(self.inputs), targets=f(self.targets),
                                   positions=None if self.positions is None
                                   else f(self.positions))

    def model_kwargs(self) -> dict[str, torch.Tensor | float]:
        """What a model's forward takes beside inputs and targets for this batch
        (dtrain.models.stages.StagedLM.forward): `positions`, `weight`, where set."""
        given = {"positions": self.positions, "weight": self.weight}
        return {k: v for k, v in given.items() if v is not None}


class View:
    """Tokens `start`..`stop`-1 of a source, sliced without copying it."""

    def __init__(self, source: Tokens, start: int, stop: int) -> None:
        self.source, self.start, self.stop = source, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: slice) -> torch.Tensor | np.ndarray:
        start, stop, step = index.indices(len(self))
        if step != 1:
            raise ValueError("a token view is sliced with step 1 only")
        return self.source[self.start + start : self.start + stop]


class TokenSequences(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of `block_size` tokens, each with its next-token targets.

    Item i is (tokens[i*B : i*B+B], tokens[i*B+1 : i*B+B+1]) as int64 tensors, B being
    `block_size`; the last token of one window is the first target of the next. With
    `targets` (a flag per token), a target whose flag is 0 is `IGNORE`.
    """

    pairs = False
    """Windows of a stream are no preference pairs."""

    def __init__(self, tokens: Tokens, block_size: int, targets: Tokens | None = None
                 ) -> None:
        self.tokens = tokens
        self.block_size = block_size
        self.targets = targets

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.block_size)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        chunk = torch.as_tensor(self.tokens[start : start + self.block_size + 1]).long()
        if self.targets is None:
            return chunk[:-1], chunk[1:]
        wanted = self._wanted(i)
        return chunk[:-1], chunk[1:].masked_fill(~wanted, IGNORE)

    def _wanted(self, i: int) -> torch.Tensor:
        assert self.targets is not None
        start = i * self.block_size
        return torch.as_tensor(self.targets[start + 1 : start + self.block_size + 1]).bool()

    def targets_in(self, rows: list[int]) -> int | None:
        if self.targets is None:
            return None
        return sum(int(self._wanted(i).sum()) for i in rows)

    def filled_in(self, rows: list[int]) -> int | None:
        return None


def split(tokens: Tokens, val_fraction: float, block_size: int) -> tuple[View, View]:
    """Split into (train, held-out) views at the end; both must hold at least one sequence.

    The held-out part is the last int(n * val_fraction) of the n tokens.

    Raises:
        ConfigError: the corpus is too small for the block size.
    """
    n = len(tokens)
    cut = n - int(n * val_fraction)
    train, val = View(tokens, 0, cut), View(tokens, cut, n)
    for name, part in (("training", train), ("held-out", val)):
        if len(part) <= block_size:
            raise ConfigError(
                f"the corpus's {name} part has {len(part)} tokens, too few for "
                f"model.block_size = {block_size}: give more data or a smaller block size"
            )
    return train, val


def check_pairs(global_batch: int, dp_size: int, accum: int = 1) -> None:
    """Whether a global batch of `global_batch` rows of preference pairs gives each of
    `dp_size` data-parallel ranks x `accum` micro-batches whole pairs.

    Raises:
        ConfigError: a rank's micro-batch would hold an odd number of rows (or the batch
            does not split evenly).
    """
    parts = dp_size * accum
    if global_batch % (2 * parts):
        each = f"{global_batch / parts:g}"
        raise ConfigError(
            f"train.batch_size = {global_batch} gives each of {dp_size} data-parallel "
            f"rank(s) x {accum} micro-batch(es) {each} rows, but preference data comes in "
            f"pairs (a chosen and a rejected row): make train.batch_size a multiple of "
            f"{2 * parts}")


def batches(
    dataset: Sequences, global_batch: int, dp_size: int, dp_rank: int, seed: int, shuffle: bool,
    accum: int = 1, start: int = 0,
) -> Iterator[Batch]:
    """Endless micro-batches of this rank's share of each global batch, from step `start`.

    Every epoch draws one permutation (the same on every rank, from `seed` and the epoch)
    and cuts it into global batches of `global_batch` sequences, dropping the tail; each
    global batch is cut into `accum` micro-batches, and rank r of `dp_size` takes every
    dp_size-th sequence of each, starting at r. Step k's global batch is therefore the same
    set of sequences whatever the number of ranks, so a run resumed in another layout
    continues on the data it would have seen, and `start` skips to step `start` directly.
    Each micro-batch is a `Batch`; where not every position is a target, it counts the
    targets of the whole global batch (each rank reads the flags of every row of it).

    Preference data (`dataset.pairs`) is drawn the same way a pair at a time: the
    permutation is of pairs, a global batch is `global_batch` / 2 pairs, a rank takes every
    dp_size-th pair of each micro-batch, and each pair gives its two rows side by side
    (chosen at even, rejected at odd positions; `Batch.pairs`). Any contiguous cut of a
    batch into parts of an even number of rows (a pipeline's micro-batches) keeps them.

    Raises:
        ConfigError: the dataset holds less than one global batch (at the first step); for
            pairs, a rank's micro-batch would hold an odd number of rows (`check_pairs`, at
            once).
    """
    if dataset.pairs:
        check_pairs(global_batch, dp_size, accum)
    return _batches(dataset, global_batch, dp_size, dp_rank, seed, shuffle, accum, start)


def _batches(dataset: Sequences, global_batch: int, dp_size: int, dp_rank: int, seed: int,
             shuffle: bool, accum: int, start: int) -> Iterator[Batch]:
    per_epoch = len(dataset) // global_batch
    if per_epoch == 0:
        raise ConfigError(
            f"the data holds {len(dataset)} sequences, fewer than one global batch of "
            f"{global_batch}: give more data or a smaller train.batch_size"
        )
    unit = 2 if dataset.pairs else 1  # rows drawn together: a pair's, or one
    units, per_batch = len(dataset) // unit, global_batch // unit
    micro = per_batch // accum
    step, epoch = start, -1
    order: torch.Tensor | None = None
    while True:
        if step // per_epoch != epoch:
            epoch = step // per_epoch
            order = (torch.randperm(units, generator=torch.Generator().manual_seed(
                seed + epoch)) if shuffle else torch.arange(units))
        assert order is not None  # drawn at the first step (epoch starts at -1)
        base = (step % per_epoch) * per_batch
        rows = _rows(order[base : base + per_batch], unit)
        total, filled = dataset.targets_in(rows), dataset.filled_in(rows)
        for m in range(accum):
            window = order[base + m * micro : base + (m + 1) * micro][dp_rank::dp_size]
            x, y, *positions = [torch.stack(f) for f in zip(
                *(dataset[i] for i in _rows(window, unit)), strict=True)]
            yield Batch(x, y, positions[0] if positions else None, total, filled,
                        pairs=unit == 2)
        step += 1


def _rows(drawn: torch.Tensor, unit: int) -> list[int]:
    """The rows of the drawn units, in order: each pair's two side by side."""
    if unit == 1:
        return drawn.tolist()
    return (drawn[:, None] * unit + torch.arange(unit)).flatten().tolist()
