"""Records of JSON lines or datasets: conversations, prompt/completion pairs and
preference pairs, read a line (a row) at a time and encoded with their target flags
(dtrain.data.chat, dtrain.data.preference). A preference record gives two documents,
chosen then rejected, kept or dropped together.

    encoded = record_documents("chats.jsonl", Kind.CHAT, tokenizer, template, "assistant")
    encoded.ids, encoded.starts, encoded.targets     # back to back, as documents

Torch is not imported here: `dtrain data prepare`'s workers encode with this alone.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np

from dtrain.data.chat import (
    ChatTemplate,
    TrainOn,
    assistant_spans,
    check_messages,
    encode_prompt_completion,
)
from dtrain.data.corpus import JSONL, corpus_files
from dtrain.data.preference import encode_pair
from dtrain.data.tables import field, is_table, table_rows
from dtrain.data.tokenizer import Tokenizer
from dtrain.errors import ConfigError


class Kind(Enum):
    """What a record of a JSON-lines file holds."""

    CHAT = "chat"
    PROMPT_COMPLETION = "prompt_completion"
    PREFERENCE = "preference"

    @property
    def documents(self) -> int:
        """Documents a record gives: two for a preference pair (chosen, rejected), else one."""
        return 2 if self is Kind.PREFERENCE else 1


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
    def join(cls, pieces: Sequence[tuple[np.ndarray, np.ndarray | None]], dtype: np.dtype,
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
        raise ConfigError(f"{key} is empty: chat, prompt_completion and preference data is a "
                          ".jsonl file or a folder of them, or a Hugging Face dataset")
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


BATCH = 512
"""Records tokenized in one call (the tokenizers library encodes a batch in parallel)."""


def encode_records(items: list[tuple[dict[str, object], str]], kind: Kind,
                   tokenizer: Tokenizer, template: ChatTemplate | None, train_on: TrainOn,
                   column: str = "") -> list[tuple[np.ndarray, np.ndarray]]:
    """Records' (record, where) ids and targets: {"messages": [...]} conversations (the
    field `column` names, "messages" by default), rendered one by one and tokenized as a
    batch; {"prompt", "completion"} pairs; or {"prompt", "chosen", "rejected"} preference
    pairs, two documents each (chosen, then rejected: `Kind.documents`).

    Raises:
        ConfigError: the fields a record needs are missing or malformed (naming where).
    """
    if kind is Kind.PROMPT_COMPLETION:
        return [_pair(record, tokenizer, template, train_on, where) for record, where in items]
    if kind is Kind.PREFERENCE:
        return [row for record, where in items
                for row in encode_pair(record, tokenizer, template, where)]
    assert template is not None  # found before reading (ChatTemplate.find)
    rendered = [assistant_spans(check_messages(field(record, column or "messages", where,
                                                     "each conversation"), where),
                                template, train_on, where=where)
                for record, where in items]
    return tokenizer.encode_spans_batch([text for text, _ in rendered],
                                        [spans for _, spans in rendered])


def _pair(record: dict[str, object], tokenizer: Tokenizer, template: ChatTemplate | None,
          train_on: TrainOn, where: str) -> tuple[np.ndarray, np.ndarray]:
    if "prompt" not in record or "completion" not in record:
        raise ConfigError(f'{where}: a prompt_completion row needs "prompt" and "completion"'
                          " fields")
    return encode_prompt_completion(record["prompt"], record["completion"], tokenizer,
                                    template, train_on, where)


def with_targets(encoded: list[tuple[np.ndarray, np.ndarray]], kind: Kind,
                 max_length: int = 0) -> tuple[list[tuple[np.ndarray, np.ndarray]], int, int]:
    """`encode_records`' documents, cut to `max_length` tokens (0: kept whole), less the
    records with a document without a target token (its first token is never predicted):
    a record's documents (`kind.documents`) are kept or dropped together, so a preference
    pair never loses one of its rows. Returns the documents kept, the records dropped and
    the records cut."""
    kept: list[tuple[np.ndarray, np.ndarray]] = []
    skipped = truncated = 0
    for first in range(0, len(encoded), kind.documents):
        record = encoded[first : first + kind.documents]
        if max_length and any(len(ids) > max_length for ids, _ in record):
            record = [(ids[:max_length], targets[:max_length]) for ids, targets in record]
            truncated += 1
        if all(targets[1:].any() for _, targets in record):
            kept.extend(record)
        else:
            skipped += 1
    return kept, skipped, truncated


def record_documents(path: str, kind: Kind, tokenizer: Tokenizer, template: ChatTemplate | None,
                     train_on: TrainOn, key: str = "data.path", column: str = "",
                     split: str = "train") -> Encoded:
    """The records of `path` encoded as documents with their targets (`column` and
    `split` as `records` and `encode_records` take them); a record with no target token
    (a preference pair with a row without one) is skipped and counted
    (`Encoded.without_targets`).

    Raises:
        ConfigError: see `records` and `encode_records`; no record with a target at all.
    """
    pieces: list[tuple[np.ndarray, np.ndarray | None]] = []
    skipped = 0
    rows = records(path, key, split)
    while True:
        batch = [(record, where) for record, where, _ in itertools.islice(rows, BATCH)]
        if not batch:
            break
        kept, dropped, _ = with_targets(
            encode_records(batch, kind, tokenizer, template, train_on, column), kind)
        pieces.extend(kept)
        skipped += dropped
    if not pieces:
        raise ConfigError(f"{key} {path!r} holds no {kind.value} record with a target token"
                          f" (train_on = {train_on!r}): give records with assistant turns or "
                          "completions")
    return Encoded.join(pieces, tokenizer.dtype, skipped)
