"""A training job's data from its `[data]` config: tokens, tokenizer, train and held-out
rows.

- format "text": text files (a file, a folder, or the stdlib when data.path is empty),
  encoded with data.tokenizer; at most data.max_bytes of text is read.
- format "jsonl": the "text" field of each line of a .jsonl file or folder, likewise.
- format "chat": conversations, a {"messages": [...]} per line of a .jsonl file or folder,
  rendered by the chat template, the assistant's turns their targets (dtrain.data.chat).
- format "prompt_completion": {"prompt", "completion"} per line, the completion the target.
- format "preference": {"prompt", "chosen", "rejected"} per line (strings, or lists of
  messages rendered by the chat template: dtrain.data.preference), two rows a pair,
  chosen then rejected, padded; the responses' tokens the targets.
- format "tokens": a folder written by `dtrain data prepare`, memory-mapped and read
  lazily; data.max_bytes does not apply. Its tokenizer is the one its index names (the
  shards were encoded with it), whatever data.tokenizer says, and so are its targets.

Rows are cut as data.packing says (dtrain.data.packing): windows of a stream, or whole
documents packed or padded into rows. "auto" streams text, packs records and pads
preference pairs (which nothing else keeps whole: stream and block_causal are refused
for them, and so is too_long = "split").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dtrain.data.chat import ChatTemplate
from dtrain.data.config import DataConfig
from dtrain.data.corpus import encode_with_starts, jsonl_documents, text_documents
from dtrain.data.documents import Documents
from dtrain.data.formats import Format, train_on_of
from dtrain.data.packing import PackedRows, Packing, TooLong
from dtrain.data.preference import check_column
from dtrain.data.records import Encoded, Kind, record_documents
from dtrain.data.sequences import Tokens, TokenSequences, View
from dtrain.data.sequences import split as hold_out
from dtrain.data.shards import TOKENIZER_FILE, TokenShards, read_index
from dtrain.data.tokenizer import BYTES, Tokenizer, load_tokenizer
from dtrain.errors import ConfigError


@dataclass
class Data:
    """A job's data: training and held-out rows, the tokenizer that made them, and what
    was made of the documents on the way (`notes`, for the banner)."""

    train: TokenSequences | PackedRows
    val: TokenSequences | PackedRows
    tokenizer: Tokenizer
    vocab_size: int
    packing: Packing = Packing.STREAM
    notes: tuple[str, ...] = ()
    pairs: bool = False
    """The rows are preference pairs: in `train` and `val`, rows 2i and 2i+1 are pair i's
    chosen and rejected rows, and every `Batch` `batches` draws from them holds whole
    pairs, chosen at even and rejected at odd positions (`Batch.pairs`)."""


def shards_tokenizer(shards_path: str, name: str, vocab_size: int,
                     key: str = "data.path") -> Tokenizer:
    """The tokenizer a shard folder's index names: bytes, or its own tokenizer.json.

    Raises:
        ConfigError: the folder lacks its tokenizer.json, or it does not match the index.
    """
    if name == BYTES:
        tokenizer = load_tokenizer(BYTES)
    else:
        file = Path(shards_path) / TOKENIZER_FILE
        if not file.is_file():
            raise ConfigError(f"{key} {shards_path!r} was encoded with {name!r} but holds no "
                              f"{TOKENIZER_FILE}: copy that tokenizer file there as "
                              f"{TOKENIZER_FILE}")
        tokenizer = load_tokenizer(str(file), key=key)
    if tokenizer.vocab_size != vocab_size:
        raise ConfigError(f"{key} {shards_path!r}: its tokenizer has {tokenizer.vocab_size} "
                          f"ids but its index says vocab_size {vocab_size}: run `dtrain data "
                          "prepare` again")
    return tokenizer


def open_data(path: str, format: str = "text", tokenizer: str = BYTES,
              max_bytes: int = 4_000_000, val_fraction: float = 0.05,
              block_size: int = 256, packing: str = "auto", train_on: str = "auto",
              too_long: str = "auto", chat_template: str = "", column: str = "",
              split: str = "train") -> Data:
    """Read (or map) the data at `path`, split it, and cut it into rows.

    Args:
        path: data.path: text file or folder (empty: the stdlib), JSONL file or folder,
            or token-shard folder.
        format: data.format: "text", "jsonl", "chat", "prompt_completion", "preference"
            or "tokens" (shards of any of them, preference pairs included).
        tokenizer: data.tokenizer: "bytes" or a tokenizer.json (not used for "tokens").
        max_bytes: data.max_bytes: text read at most (text and jsonl).
        val_fraction: the held-out share of the tokens (of the documents when packed),
            taken at the end.
        block_size: positions per row.
        packing, train_on, too_long, chat_template, column, split: the `[data]` keys of
            those names (dtrain.data.config.DataConfig).

    Raises:
        ConfigError: a bad format, tokenizer, path, record or combination of keys, no
            text, bad shards, or too few tokens for one row on each side; the message
            names the config key.
    """
    fmt = Format.parse(format)
    kind = fmt.records
    targets = train_on_of(fmt, train_on)
    tokens: Tokens
    flags: Tokens | None = None
    starts: np.ndarray | None = None
    notes: list[str] = []
    pairs = kind is Kind.PREFERENCE
    if pairs:
        check_column(column)
    if fmt is Format.TOKENS:
        shards = TokenShards(path)
        pairs = shards.pairs
        tok = shards_tokenizer(path, shards.tokenizer, shards.vocab_size)
        if not len(shards):
            raise ConfigError(f"data.path {path!r} holds no tokens: run `dtrain data prepare` "
                              "again on a corpus with text")
        tokens, flags, starts = shards, shards.targets, shards.document_starts()
    elif kind is not None:
        tok = load_tokenizer(tokenizer)
        template = ChatTemplate.for_records(tokenizer, chat_template, kind is Kind.CHAT)
        encoded = record_documents(path, kind, tok, template, targets, column=column,
                                   split=split)
        if encoded.without_targets:
            what = "preference pair(s)" if pairs else "record(s)"
            notes.append(f"{encoded.without_targets} {what} without a target token skipped")
        tokens, flags, starts = torch.from_numpy(encoded.ids), _flags(encoded), encoded.starts
    else:
        tok = load_tokenizer(tokenizer)
        documents = text_documents(path) if fmt is Format.TEXT else jsonl_documents(
            path, column=column, split=split)
        ids, starts = encode_with_starts(documents, tok, max_bytes)
        tokens = torch.from_numpy(ids)
        if not len(tokens):
            raise ConfigError(f"data.path {path!r} holds no text")
    how = _packing(packing, fmt, flags is not None, pairs)
    if how is Packing.STREAM:
        train, val = hold_out(tokens, val_fraction, block_size)
        train_flags = val_flags = None
        if flags is not None:
            train_flags = View(flags, train.start, train.stop)
            val_flags = View(flags, val.start, val.stop)
        return Data(TokenSequences(train, block_size, train_flags),
                    TokenSequences(val, block_size, val_flags), tok, tok.vocab_size, how,
                    tuple(notes))
    if starts is None:
        raise ConfigError(f"data.path {path!r} was prepared before token shards kept their "
                          f"documents: run `dtrain data prepare` again to pack it "
                          f"(data.packing = {how.value!r}), or set data.packing = \"stream\"")
    cut = _too_long(too_long, flags is not None, pairs)
    every = Documents(tokens, starts, flags)
    rows = [PackedRows(part, block_size, how, cut, pairs)
            for part in every.split(val_fraction, unit=2 if pairs else 1)]
    if rows[0].cut and pairs:
        notes.append(f"{rows[0].cut} preference row(s) longer than {block_size} + 1 tokens "
                     "cut at their response's end")
    elif rows[0].cut:
        notes.append(f"{rows[0].cut} document(s) longer than {block_size} + 1 tokens "
                     f"{'split' if cut is TooLong.SPLIT else 'truncated'}")
    dropped = rows[0].dropped + rows[1].dropped
    if dropped:
        notes.append(f"{dropped} preference pair(s) whose prompt leaves no response token in "
                     f"{block_size} positions skipped")
    what = "preference pairs" if pairs else "documents"
    count = len(every) // 2 if pairs else len(every)
    notes.append(f"{how.value} packing: {count:,} {what} in {len(rows[0]):,} "
                 f"training rows, {rows[0].padding():.1%} padding")
    for name, part in zip(("training", "held-out"), rows, strict=True):
        if not len(part):
            raise ConfigError(f"the data's {name} part holds no document of two tokens or "
                              "more: give more data")
    return Data(rows[0], rows[1], tok, tok.vocab_size, how, tuple(notes), pairs)


def data_of(dc: DataConfig, block_size: int) -> Data:
    """`open_data` of a job's `[data]` section."""
    return open_data(dc.path, dc.format, dc.tokenizer, dc.max_bytes, dc.val_fraction,
                     block_size, dc.packing, dc.train_on, dc.too_long, dc.chat_template,
                     dc.column, dc.split)


def _flags(encoded: Encoded) -> torch.Tensor | None:
    return None if encoded.targets is None else torch.from_numpy(encoded.targets)


def _packing(value: str, fmt: Format, masked: bool, pairs: bool = False) -> Packing:
    """data.packing: auto streams text, packs records (`block_causal`) and pads preference
    pairs (`pad`, the one packing that keeps a pair's rows whole and adjacent).

    Raises:
        ConfigError: an unknown value; for preference pairs, any packing but pad.
    """
    if value == "auto":
        if pairs:
            return Packing.PAD
        return Packing.BLOCK_CAUSAL if fmt.records is not None or masked else Packing.STREAM
    try:
        how = Packing(value)
    except ValueError:
        names = ", ".join(repr(p.value) for p in Packing)
        raise ConfigError(f"data.packing = {value!r} is unknown: give auto, {names}") from None
    if pairs and how is not Packing.PAD:
        raise ConfigError(f"data.packing = {value!r} does not keep preference pairs whole (a "
                          'chosen and a rejected row each): set data.packing = "pad" or "auto"')
    return how


def _too_long(value: str, records: bool, pairs: bool = False) -> TooLong:
    """data.too_long: auto splits text documents and truncates records (a conversation cut
    in two loses its prompt) and preference pairs (their responses' ends).

    Raises:
        ConfigError: an unknown value; split for preference pairs.
    """
    if value == "auto":
        return TooLong.TRUNCATE if records or pairs else TooLong.SPLIT
    try:
        how = TooLong(value)
    except ValueError:
        raise ConfigError(f"data.too_long = {value!r} is unknown: give auto, split, truncate "
                          "or refuse") from None
    if pairs and how is TooLong.SPLIT:
        raise ConfigError('data.too_long = "split" does not apply to preference pairs (half a '
                          'response is no response): set it to "truncate" (cuts the '
                          'response\'s end) or "refuse"')
    return how


def vocab_of(path: str, format: str = "text", tokenizer: str = BYTES) -> int:
    """The vocabulary size of the data `open_data` would give, cheaply: from the shards'
    index, or from the tokenizer (no corpus is read).

    Raises:
        ConfigError: a bad format, tokenizer, or shard index.
    """
    if Format.parse(format) is Format.TOKENS:
        vocab_size: int = read_index(path)["vocab_size"]
        return vocab_size
    return load_tokenizer(tokenizer).vocab_size
