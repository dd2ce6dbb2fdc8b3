"""A corpus as documents: token ids, where each document starts, and which ids are targets.

    docs = Documents(tokens, starts, targets)     # tokens[starts[i]:starts[i+1]] is doc i
    docs.ids(3), docs.targets_of(3)              # its ids, and which of them are targets

The token stream is the same stream of ids `encode_documents` writes (text documents joined
by the tokenizer's separator, each document's range ending with the separator after it;
conversations back to back, each ending with its template's end-of-turn token); the
document starts and the targets lie beside it, in memory or in token shards
(dtrain.data.shards). A target flag belongs to the token predicted: token j of a document
is a target when the loss counts predicting it from the tokens before it.

Records (chat and prompt/completion rows) are read and encoded by dtrain.data.records.
"""

from __future__ import annotations

import numpy as np
import torch

from dtrain.data.sequences import Tokens, View
from dtrain.errors import ConfigError


class Documents:
    """Documents of a token source: document i is `tokens[starts[i]:starts[i+1]]`.

    Args:
        tokens: the ids (a tensor, an array, TokenShards or a View).
        starts: int64 offsets, one per document and one past the last.
        targets: per token, 1 if it is a target (same length as `tokens`); None: all are.
        first: the number its document 0 has in the whole data (a held-out part's is not
            0), for messages.
    """

    def __init__(self, tokens: Tokens, starts: np.ndarray, targets: Tokens | None = None,
                 first: int = 0) -> None:
        self.tokens, self.starts, self.targets = tokens, starts, targets
        self.first = first

    def __len__(self) -> int:
        return len(self.starts) - 1

    def lengths(self) -> np.ndarray:
        """Every document's length in tokens."""
        return np.diff(self.starts)

    def ids(self, i: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Ids `start`..`stop`-1 of document i, as int64."""
        first = int(self.starts[i])
        end = int(self.starts[i + 1]) if stop is None else first + stop
        return torch.as_tensor(self.tokens[first + start : end]).long()

    def targets_of(self, i: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Whether ids `start`..`stop`-1 of document i are targets (bool)."""
        first = int(self.starts[i])
        end = int(self.starts[i + 1]) if stop is None else first + stop
        if self.targets is None:
            return torch.ones(end - first - start, dtype=torch.bool)
        return torch.as_tensor(self.targets[first + start : end]).bool()

    def split(self, val_fraction: float, unit: int = 1) -> tuple[Documents, Documents]:
        """(training, held-out) documents: the held-out are the last
        int(n * val_fraction), at least one; both sides need one. With `unit` 2 the
        documents go in pairs (preference data: chosen, rejected), counted and cut as
        pairs, so no pair is split.

        Raises:
            ConfigError: fewer than two documents (pairs).
        """
        n = len(self) // unit
        if n < 2:
            what = "document(s)" if unit == 1 else "preference pair(s)"
            raise ConfigError(f"the data holds {n} {what}: packed training needs at least "
                              "two (one held out for evaluation); give more data")
        cut = (n - max(1, int(n * val_fraction))) * unit
        return self._part(0, cut), self._part(cut, n * unit)

    def _part(self, first: int, last: int) -> Documents:
        a, b = int(self.starts[first]), int(self.starts[last])
        targets = None if self.targets is None else View(self.targets, a, b)
        return Documents(View(self.tokens, a, b), self.starts[first : last + 1] - a, targets,
                         self.first + first)
