"""Documents packed into training rows: whole documents that do not see each other, one
document per padded row, or today's stream.

    rows = PackedRows(documents, block_size=2048, packing=Packing.BLOCK_CAUSAL)
    x, y, positions = rows[0]      # ids, targets (-100: no loss), places in each document

A document of L tokens gives L - 1 training positions: its tokens but the last as inputs,
the tokens after them as targets (a token that is no target, a prompt's say, gets -100,
the index cross-entropy ignores). Packing (`[data] packing`):

- `block_causal`: documents are packed whole into rows of `block_size` positions, best
  fit by decreasing length (few rows, little padding); the rest of a row is padding
  (inputs 0, targets -100). `positions` restart at 0 at each document, so rotary and
  learned positions are each document's own, and attention sees only the tokens of the
  same document (a new document is where the position is 0: dtrain.models.rows).
  The first token of a document is never the target of the one before it, which belongs
  to another document.
- `pad`: one document per row, padded at the end. Causal attention is already exact here
  (padding follows the document), so no positions are given: a layout that cannot pass
  document masks along can still train on it.
- `stream`: the documents joined, cut into windows as `TokenSequences` does (targets that
  are no target flag get -100).

A document longer than a row (`[data] too_long`): `split` into pieces of `block_size`
positions (each piece an attention block of its own, its positions from 0, as each
window of a stream starts afresh), `truncate` to its first `block_size` positions, or
`refuse`.

Preference pairs (`pairs=True`: documents 2i and 2i+1 are a pair's chosen and rejected
rows, dtrain.data.preference) are padded, one row each, so row 2i is chosen and row 2i+1
rejected; a pair is kept or dropped whole (`pair_pieces`). `truncate` cuts a row's end
(the response's: the prompt comes first), and a pair a row of which keeps no target (its
prompt fills the row) is dropped and counted; `split` is refused (half a response is no
response).
"""

from __future__ import annotations

import bisect
from enum import Enum

import numpy as np
import torch
from torch.utils.data import Dataset

from dtrain.data.documents import Documents
from dtrain.data.sequences import IGNORE
from dtrain.errors import ConfigError


class Packing(Enum):
    """How documents become rows (see the module doc)."""

    STREAM = "stream"
    BLOCK_CAUSAL = "block_causal"
    PAD = "pad"


class TooLong(Enum):
    """What becomes of a document longer than a row."""

    SPLIT = "split"
    TRUNCATE = "truncate"
    REFUSE = "refuse"


def pieces(lengths: np.ndarray, block_size: int, too_long: TooLong
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The training pieces of documents of `lengths` tokens: (document, first token,
    positions) arrays, and how many documents were cut. A document of fewer than two
    tokens gives none.

    Raises:
        ConfigError: a document longer than a row under `refuse`.
    """
    positions = lengths.astype(np.int64) - 1
    long = np.flatnonzero(positions > block_size)
    if len(long) and too_long is TooLong.REFUSE:
        first = int(long[0])
        raise ConfigError(f"document {first} has {int(lengths[first])} tokens, more than "
                          f"model.block_size = {block_size} + 1: set [data] too_long = "
                          '"truncate" or "split", or a larger block size')
    docs = np.flatnonzero(positions > 0)
    counts = np.ones(len(docs), dtype=np.int64)
    if too_long is TooLong.SPLIT:
        counts = -(-positions[docs] // block_size)  # pieces per document, rounded up
    doc = np.repeat(docs, counts)
    within = np.arange(len(doc)) - np.repeat(np.cumsum(counts) - counts, counts)
    start = within * block_size
    size = np.minimum(positions[doc] - start, block_size)
    return doc, start, size, len(long)


def pair_pieces(documents: Documents, block_size: int, too_long: TooLong
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """The pieces of preference pairs (documents 2i chosen, 2i+1 rejected), one per
    document, as `pieces` gives them, each pair whole: (document, first token, positions)
    arrays, how many documents were cut to `block_size` positions, and how many pairs were
    dropped because a row of theirs has no target left once cut, or none at all.

    Raises:
        ConfigError: a document longer than a row under `refuse`.
        ValueError: `split`, or an odd number of documents.
    """
    if too_long is TooLong.SPLIT or len(documents) % 2:
        raise ValueError("preference pairs are truncated or refused, never split, and come "
                         "in twos")
    lengths = documents.lengths()
    positions = lengths.astype(np.int64) - 1
    long = np.flatnonzero(positions > block_size)
    if len(long) and too_long is TooLong.REFUSE:
        number = documents.first + int(long[0])
        row = "chosen" if number % 2 == 0 else "rejected"
        raise ConfigError(f"preference pair {number // 2} (from 0, in the data's order) has a "
                          f"{row} row of {int(lengths[long[0]])} tokens, more than "
                          f"model.block_size = {block_size} + 1: set [data] too_long = "
                          '"truncate" (cuts the response\'s end) or a larger block size')
    keep = positions.reshape(-1, 2).min(axis=1) > 0
    for i in long.tolist():  # a cut row keeps a target when its prompt leaves room
        if keep[i // 2] and not bool(documents.targets_of(i, 1, block_size + 1).any()):
            keep[i // 2] = False
    docs = np.flatnonzero(np.repeat(keep, 2))
    size = np.minimum(positions[docs], block_size)
    cut = int(np.count_nonzero(positions[docs] > block_size))
    return docs, np.zeros(len(docs), dtype=np.int64), size, cut, int(np.count_nonzero(~keep))


def best_fit(sizes: np.ndarray, block_size: int) -> list[list[int]]:
    """Pieces of `sizes` into rows of `block_size`, best fit by decreasing size: each
    piece, the largest first, goes to the open row it fills the most. Each row lists its
    pieces in their order."""
    order = sorted(range(len(sizes)), key=lambda i: (-int(sizes[i]), i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in order:
        size = int(sizes[i])
        at = bisect.bisect_left(free, (size, -1))
        if at < len(free):
            room, row = free.pop(at)
        else:
            room, row = block_size, len(rows)
            rows.append([])
        rows[row].append(i)
        if room - size > 0:
            bisect.insort(free, (room - size, row))
    return [sorted(r) for r in rows]


class PackedRows(Dataset[tuple[torch.Tensor, ...]]):
    """Rows of `block_size` positions packed from `documents` (see the module doc).

    Item i is (inputs, targets, positions) for `block_causal`, (inputs, targets) for `pad`.
    With `pairs` (preference data, padded), rows 2i and 2i+1 are pair i's chosen and
    rejected rows; `dropped` counts the pairs left out (`pair_pieces`).

    Raises:
        ConfigError: see `pieces` and `pair_pieces`.
        ValueError: pairs with a packing other than `pad`.
    """

    def __init__(self, documents: Documents, block_size: int, packing: Packing,
                 too_long: TooLong = TooLong.SPLIT, pairs: bool = False) -> None:
        self.documents, self.block_size, self.packing = documents, block_size, packing
        self.pairs = pairs
        """Rows come in preference pairs: 2i chosen, 2i+1 rejected."""
        self.dropped = 0
        if pairs:
            if packing is not Packing.PAD:
                raise ValueError("preference pairs are padded, a row each")
            self.doc, self.start, self.size, self.cut, self.dropped = pair_pieces(
                documents, block_size, too_long)
        else:
            self.doc, self.start, self.size, self.cut = pieces(documents.lengths(),
                                                               block_size, too_long)
        if packing is Packing.BLOCK_CAUSAL:
            self.rows = best_fit(self.size, block_size)
        else:
            self.rows = [[i] for i in range(len(self.size))]

    def __len__(self) -> int:
        return len(self.rows)

    def padding(self) -> float:
        """The share of the rows' positions that are padding."""
        return 1.0 - float(self.size.sum()) / max(1, len(self.rows) * self.block_size)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        b = self.block_size
        x = torch.zeros(b, dtype=torch.long)
        y = torch.full((b,), IGNORE, dtype=torch.long)
        positions = torch.zeros(b, dtype=torch.long)
        at = 0
        for piece in self.rows[i]:
            doc, start, n = int(self.doc[piece]), int(self.start[piece]), int(self.size[piece])
            ids = self.documents.ids(doc, start, start + n + 1)
            wanted = self.documents.targets_of(doc, start + 1, start + n + 1)
            x[at : at + n] = ids[:-1]
            y[at : at + n] = ids[1:].masked_fill(~wanted, IGNORE)
            positions[at : at + n] = torch.arange(n)
            at += n
        positions[at:] = torch.arange(b - at)  # the padding: a block of its own
        if self.packing is Packing.PAD:
            return x, y
        return x, y, positions

    def filled_in(self, rows: list[int]) -> int:
        """How many positions of `rows` hold a document (not padding)."""
        return sum(int(self.size[piece]) for i in rows for piece in self.rows[i])

    def targets_in(self, rows: list[int]) -> int:
        """How many positions of `rows` are targets (the loss's denominator)."""
        total = 0
        for i in rows:
            for piece in self.rows[i]:
                doc, start, n = int(self.doc[piece]), int(self.start[piece]), int(self.size[piece])
                total += int(self.documents.targets_of(doc, start + 1, start + n + 1).sum())
        return total
