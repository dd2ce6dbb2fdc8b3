"""A corpus as documents: token ids, where each document starts, and which ids are targets.

    docs = Documents(tokens, starts, targets)     # tokens[starts[i]:starts[i+1]] is doc i
    docs.ids(3), docs.targets_of(3)              # its ids, and which of them are targets

The token stream is the same stream of ids `encode_documents` writes (text documents joined
by the tokenizer's separator, each document's range ending with the separator after it;
conversations back to back, each ending with its template's end-of-turn token); the
document starts and the targets lie beside it, in memory or in token shards
(dtrain.data.shards). A target flag belongs to the token predicted: token j of a document
is a target when the loss counts predicting it from the tokens before it.

Records are read here too: the rows of a chat or prompt/completion JSON-lines file
(`record_documents`), encoded with their loss masks (dtrain.data.chat).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch

from dtrain.data.chat import (
    ChatTemplate,
    TrainOn,
    check_messages,
    encode_chat,
    encode_prompt_completion,
)
from dtrain.data.corpus import JSONL, corpus_files
from dtrain.data.sequences import Tokens, View
from dtrain.data.tables import field, is_table, table_rows
from dtrain.data.tokenizer import Tokenizer
from dtrain.errors import ConfigError


class Kind(Enum):
    """What a record of a JSON-lines file holds."""

    CHAT = "chat"
    PROMPT_COMPLETION = "prompt_completion"


@dataclass
class Encoded:
    """Documents encoded in memory: their ids back to back, starts, targets, and what was
    dropped on the way."""

    ids: np.ndarray
    starts: np.ndarray
    targets: np.ndarray | None
    without_targets: int = 0
    """Records skipped because none of their tokens is a target."""

    @classmethod
    def join(cls, pieces: list[tuple[np.ndarray, np.ndarray | None]], dtype: np.dtype,
             without_targets: int = 0) -> Encoded:
        """Documents' (ids, targets or None) joined back to back."""
        lengths = [len(ids) for ids, _ in pieces]
        starts = np.zeros(len(pieces) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        ids = np.concatenate([i for i, _ in pieces]) if pieces else np.zeros(0, dtype)
        flags = None
        if any(t is not None for _, t in pieces):
            flags = np.concatenate([np.ones(len(i), bool) if t is None else t
                                    for i, t in pieces])
        return cls(ids.astype(dtype, copy=False), starts, flags, without_targets)


class Documents:
    """Documents of a token source: document i is `tokens[starts[i]:starts[i+1]]`.

    Args:
        tokens: the ids (a tensor, an array, TokenShards or a View).
        starts: int64 offsets, one per document and one past the last.
        targets: per token, 1 if it is a target (same length as `tokens`); None: all are.
    """

    def __init__(self, tokens: Tokens, starts: np.ndarray, targets: Tokens | None = None
                 ) -> None:
        self.tokens, self.starts, self.targets = tokens, starts, targets

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

    def split(self, val_fraction: float) -> tuple[Documents, Documents]:
        """(training, held-out) documents: the held-out are the last
        int(n * val_fraction), at least one; both sides need one.

        Raises:
            ConfigError: fewer than two documents.
        """
        n = len(self)
        if n < 2:
            raise ConfigError(f"the data holds {n} document(s): packed training needs at least "
                              "two (one held out for evaluation); give more data")
        cut = n - max(1, int(n * val_fraction))
        return self._part(0, cut), self._part(cut, n)

    def _part(self, first: int, last: int) -> Documents:
        a, b = int(self.starts[first]), int(self.starts[last])
        targets = None if self.targets is None else View(self.targets, a, b)
        return Documents(View(self.tokens, a, b), self.starts[first : last + 1] - a, targets)


def records(path: str, key: str = "data.path", split: str = "train"
            ) -> Iterator[tuple[dict[str, object], str, int]]:
    """Each JSON object of a .jsonl file or a folder's .jsonl files (recursively, sorted),
    with where it is ("file:line") and its line's size in bytes; blank lines skipped.
    Lines are read one at a time. A Hugging Face dataset folder or parquet files give
    their rows instead (dtrain.data.tables; a saved dataset's `split`).

    Raises:
        ConfigError: the path is missing, a file cannot be read, or a line is no object.
    """
    if not path:
        raise ConfigError(f"{key} is empty: chat and prompt_completion data is a .jsonl file "
                          "or a folder of them, or a Hugging Face dataset")
    if is_table(path):
        yield from table_rows(path, split, key)
        return
    for file in corpus_files(path, key, suffix=JSONL):
        try:
            with file.open("rb") as lines:
                for number, raw in enumerate(lines, start=1):
                    if not raw.strip():
                        continue
                    where = f"{file}:{number}"
                    try:
                        record = json.loads(raw)
                    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                        raise ConfigError(f"{where}: not a valid JSON line of UTF-8 text "
                                          f"({exc})") from exc
                    if not isinstance(record, dict):
                        raise ConfigError(f"{where}: each line must be a JSON object")
                    yield record, where, len(raw)
        except OSError as exc:
            raise ConfigError(f"{key} {path!r}: {file} cannot be read ({exc.strerror or exc})"
                              ) from exc


def encode_record(record: dict[str, object], kind: Kind, tokenizer: Tokenizer,
                  template: ChatTemplate | None, train_on: TrainOn, where: str,
                  column: str = "") -> tuple[np.ndarray, np.ndarray]:
    """One record's ids and targets: a {"messages": [...]} conversation (the field
    `column` names, "messages" by default), or a {"prompt", "completion"} pair.

    Raises:
        ConfigError: the fields it needs are missing or malformed (naming `where`).
    """
    if kind is Kind.CHAT:
        messages = field(record, column or "messages", where, "each conversation")
        assert template is not None  # found before reading (ChatTemplate.find)
        return encode_chat(check_messages(messages, where), template, tokenizer,
                           train_on, where=where)
    if "prompt" not in record or "completion" not in record:
        raise ConfigError(f'{where}: a prompt_completion row needs "prompt" and "completion"'
                          " fields")
    return encode_prompt_completion(record["prompt"], record["completion"], tokenizer,
                                    template, train_on, where)


def record_documents(path: str, kind: Kind, tokenizer: Tokenizer, template: ChatTemplate | None,
                     train_on: TrainOn, key: str = "data.path", column: str = "",
                     split: str = "train") -> Encoded:
    """The records of `path` encoded as documents with their targets (`column` and
    `split` as `records` and `encode_record` take them); a record with no target token
    is skipped and counted (`Encoded.without_targets`).

    Raises:
        ConfigError: see `records` and `encode_record`; no record with a target at all.
    """
    pieces: list[tuple[np.ndarray, np.ndarray | None]] = []
    skipped = 0
    for record, where, _ in records(path, key, split):
        ids, targets = encode_record(record, kind, tokenizer, template, train_on, where,
                                     column)
        if not targets[1:].any():  # the first token is never predicted
            skipped += 1
            continue
        pieces.append((ids, targets))
    if not pieces:
        raise ConfigError(f"{key} {path!r} holds no {kind.value} record with a target token"
                          f" (train_on = {train_on!r}): give records with assistant turns or "
                          "completions")
    return Encoded.join(pieces, tokenizer.dtype, skipped)
