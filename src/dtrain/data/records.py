"""Records of JSON lines or datasets: conversations and prompt/completion pairs, read a
line (a row) at a time and encoded with their target flags (dtrain.data.chat).

    encoded = record_documents("chats.jsonl", Kind.CHAT, tokenizer, template, "assistant")
    encoded.ids, encoded.starts, encoded.targets     # back to back, as documents

Torch is not imported here: `dtrain data prepare`'s workers encode with this alone.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
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


BATCH = 512
"""Records tokenized in one call (the tokenizers library encodes a batch in parallel)."""


def encode_records(items: list[tuple[dict[str, object], str]], kind: Kind,
                   tokenizer: Tokenizer, template: ChatTemplate | None, train_on: TrainOn,
                   column: str = "") -> list[tuple[np.ndarray, np.ndarray]]:
    """Records' (record, where) ids and targets: {"messages": [...]} conversations (the
    field `column` names, "messages" by default), rendered one by one and tokenized as a
    batch; or {"prompt", "completion"} pairs.

    Raises:
        ConfigError: the fields a record needs are missing or malformed (naming where).
    """
    if kind is Kind.PROMPT_COMPLETION:
        return [_pair(record, tokenizer, template, train_on, where) for record, where in items]
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


def record_documents(path: str, kind: Kind, tokenizer: Tokenizer, template: ChatTemplate | None,
                     train_on: TrainOn, key: str = "data.path", column: str = "",
                     split: str = "train") -> Encoded:
    """The records of `path` encoded as documents with their targets (`column` and
    `split` as `records` and `encode_records` take them); a record with no target token
    is skipped and counted (`Encoded.without_targets`).

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
        for ids, targets in encode_records(batch, kind, tokenizer, template, train_on, column):
            if not targets[1:].any():  # the first token is never predicted
                skipped += 1
                continue
            pieces.append((ids, targets))
    if not pieces:
        raise ConfigError(f"{key} {path!r} holds no {kind.value} record with a target token"
                          f" (train_on = {train_on!r}): give records with assistant turns or "
                          "completions")
    return Encoded.join(pieces, tokenizer.dtype, skipped)
