"""Documents of a corpus, read lazily, and their token ids.

A corpus is text files (a file, or a folder read recursively in sorted order: one
document per file, read whole), JSON lines (a file, or a folder's `*.jsonl` files: one
document per line, its "text" field), or, when the path is empty, the Python standard
library's own .py files, which every installation ships, so the demo needs no download.
Documents are read one at a time, so a corpus is never held whole before it is encoded.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from dtrain.data.tables import field, is_table, table_rows
from dtrain.data.tokenizer import ByteTokenizer, Tokenizer
from dtrain.errors import ConfigError

Document = str | bytes
"""A JSONL line's text, or a text file's bytes."""

JSONL = ".jsonl"


def stdlib_files() -> list[Path]:
    """The standard library's .py files (not its tests, idlelib or site-packages), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [s for s in subfolders if s not in skip]  # never descended into
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    return sorted(found)


def corpus_files(path: str, key: str = "data.path", suffix: str = "") -> list[Path]:
    """The files of `path`: itself if a file, else the files under it ending in `suffix`
    (recursively, in sorted order).

    Raises:
        ConfigError: `path` does not exist; the message names `key`.
    """
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{key} {path!r} does not exist")
    if p.is_file():
        return [p]
    return sorted(f for f in p.rglob(f"*{suffix}") if f.is_file())


def _read(file: Path, key: str, given: str) -> bytes:
    try:
        return file.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{key} {given!r}: {file} cannot be read ({exc.strerror or exc}): "
                          "check its permissions") from exc


def _text_of(file: Path, key: str, given: str, alone: bool) -> bytes | None:
    """A text file's bytes; None for a binary file in a folder, which may hold a stray one."""
    data = _read(file, key, given)
    if b"\0" in data[:8192]:
        if alone:
            raise ConfigError(f"{key} {given!r} looks binary (NUL bytes): give a text file")
        return None
    return data


def _jsonl_lines(file: Path, key: str, given: str) -> Iterator[tuple[str, int]]:
    """The "text" field of each line of a JSONL file, with the line's size in bytes."""
    try:
        with file.open("rb") as lines:
            for number, raw in enumerate(lines, start=1):
                where = f"{key} {given!r}: {file}:{number}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise ConfigError(f"{where}: not UTF-8 ({exc.reason}): JSON lines must be "
                                      "UTF-8 text") from exc
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{where}: not valid JSON ({exc.msg}, column {exc.colno}):"
                                      ' each line must be an object like {"text": "..."}') from exc
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise ConfigError(f'{where}: no "text" string field: each line must be an '
                                      'object like {"text": "..."}')
                yield record["text"], len(raw)
    except OSError as exc:
        raise ConfigError(f"{key} {given!r}: {file} cannot be read ({exc.strerror or exc}): "
                          "check its permissions") from exc


def text_documents(path: str, key: str = "data.path") -> Iterator[bytes]:
    """The bytes of each text file of `path` (a file or a folder), or of the standard
    library's .py files when `path` is empty. A binary file (NUL bytes) in a folder is
    skipped; given alone, it is refused.

    Raises:
        ConfigError: the path does not exist, is binary, or a file cannot be read.
    """
    files = stdlib_files() if not path else corpus_files(path, key)
    given = path or "stdlib"
    for file in files:
        data = _text_of(file, key, given, alone=len(files) == 1)
        if data is not None:
            yield data


def jsonl_documents(path: str, key: str = "data.path", column: str = "",
                    split: str = "train") -> Iterator[str]:
    """The "text" field of each line of a JSONL file, or of the `*.jsonl` files of a folder
    (recursively, in sorted order); blank lines are skipped. A Hugging Face dataset
    folder or parquet files give their rows' `column` ("text" by default; a saved
    dataset's `split`: dtrain.data.tables).

    Raises:
        ConfigError: the path is empty or does not exist, a file cannot be read, or a line
            is not a JSON object with a "text" string (the message names file and line).
    """
    if not path:
        raise ConfigError(f'{key} is empty: data.format = "jsonl" needs a .jsonl file or a '
                          "folder of them, or a Hugging Face dataset")
    if is_table(path):
        for row, where, _ in table_rows(path, split, key):
            yield _text_field(row, column or "text", where)
        return
    for file in corpus_files(path, key, suffix=JSONL):
        for text, _ in _jsonl_lines(file, key, path):
            yield text


def _text_field(row: dict[str, object], column: str, where: str) -> str:
    text = field(row, column, where, "each document's text")
    if not isinstance(text, str):
        raise ConfigError(f"{where}: its {column!r} field is not a string: give data.column "
                          "(or --column) the field that holds the text")
    return text


def table_documents(path: str, column: str = "", split: str = "train", key: str = "input"
                    ) -> Iterator[tuple[Document | None, int]]:
    """The texts of a table's rows (`column`, "text" by default), each with its share of
    the table's bytes: `input_documents` of a Hugging Face dataset or parquet files."""
    for row, where, size in table_rows(path, split, key):
        yield _text_field(row, column or "text", where), size


def input_documents(listings: list[tuple[str, list[Path]]], key: str = "input",
                    ) -> Iterator[tuple[Document | None, int]]:
    """The documents of several inputs, each with its size in its file in bytes (for
    progress): a file ending in .jsonl gives one document per line, any other file one
    document of its bytes. A binary file in a folder is skipped: it gives (None, its
    size), so that progress counts it; given alone, it is refused.

    Args:
        listings: each input as given, with its files (from `corpus_files`).
        key: what the inputs are called in messages.

    Raises:
        ConfigError: a file cannot be read, is binary alone, or has a bad JSON line.
    """
    for given, files in listings:
        for file in files:
            if file.suffix == JSONL:
                yield from _jsonl_lines(file, key, given)
                continue
            data = _text_of(file, key, given, alone=len(files) == 1)
            yield data, file.stat().st_size if data is None else len(data)


def _cut(document: Document, budget: int) -> tuple[Document, int]:
    """The document cut to `budget` bytes of UTF-8, and its size before the cut."""
    raw = document.encode("utf-8") if isinstance(document, str) else document
    if len(raw) <= budget:
        return document, len(raw)
    if isinstance(document, str):
        return raw[:budget].decode("utf-8", errors="ignore"), len(raw)
    return raw[:budget], len(raw)


def encode_documents(documents: Iterable[Document], tokenizer: Tokenizer,
                     max_bytes: int | None = None) -> np.ndarray:
    """The token ids of `documents` joined by the tokenizer's separator (none after the
    last), as a 1-D array of `tokenizer.dtype`.

    With `max_bytes`, documents are read until `max_bytes` bytes of text have been read
    (separators not counted; the last one cut to fit), and the ids are cut at `max_bytes`
    tokens. For the bytes tokenizer on text files this is exactly `read_corpus`: the files
    joined by b"\\n", cut at `max_bytes`. A subword tokenizer gives fewer tokens than
    bytes, so its stream holds roughly `max_bytes` bytes of text.
    """
    return encode_with_starts(documents, tokenizer, max_bytes)[0]


def encode_with_starts(documents: Iterable[Document], tokenizer: Tokenizer,
                       max_bytes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`encode_documents`, and where each document starts in it (int64, one offset per
    document and one past the end): document i's range holds the separator after it."""
    separator = np.asarray(tokenizer.separator, dtype=tokenizer.dtype)
    pieces: list[np.ndarray] = []
    lengths: list[int] = []
    budget = max_bytes
    for document in documents:
        if budget is not None:
            if budget <= 0:
                break
            document, size = _cut(document, budget)
            budget -= size
        if pieces:
            pieces.append(separator)
            lengths[-1] += len(separator)
        pieces.append(tokenizer.encode_document(document))
        lengths.append(len(pieces[-1]))
    ids = np.concatenate(pieces) if pieces else np.zeros(0, dtype=tokenizer.dtype)
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    if max_bytes is not None:
        ids = ids[:max_bytes]
        starts = np.minimum(starts, len(ids))
        starts = starts[: np.searchsorted(starts, len(ids)) + 1]
    return ids, starts


def read_corpus(path: str, max_bytes: int) -> bytes:
    """Read up to `max_bytes` of text from a file, a folder (recursively), or the stdlib.

    The files are joined by b"\\n" and cut at `max_bytes`.

    Raises:
        ConfigError: the path is missing, empty, or binary.
    """
    data = encode_documents(text_documents(path), ByteTokenizer(), max_bytes).tobytes()
    if not data:
        raise ConfigError(f"data.path {path!r} holds no text")
    return data
