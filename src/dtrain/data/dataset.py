"""A training job's data from its `[data]` config: tokens, tokenizer, train and held-out
sequences.

- format "text": text files (a file, a folder, or the stdlib when data.path is empty),
  encoded with data.tokenizer; at most data.max_bytes of text is read.
- format "jsonl": the "text" field of each line of a .jsonl file or folder, likewise.
- format "tokens": a folder written by `dtrain data prepare`, memory-mapped and read
  lazily; data.max_bytes does not apply. Its tokenizer is the one its index names (the
  shards were encoded with it), whatever data.tokenizer says.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch

from dtrain.data.corpus import encode_documents, jsonl_documents, text_documents
from dtrain.data.sequences import Tokens, TokenSequences, split
from dtrain.data.shards import TOKENIZER_FILE, TokenShards, read_index
from dtrain.data.tokenizer import BYTES, Tokenizer, load_tokenizer
from dtrain.errors import ConfigError


class Format(Enum):
    """How data.path is read."""

    TEXT = "text"
    JSONL = "jsonl"
    TOKENS = "tokens"

    @classmethod
    def parse(cls, value: str, key: str = "data.format") -> Format:
        """The format named `value`.

        Raises:
            ConfigError: no format has that name.
        """
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(repr(f.value) for f in cls)
            raise ConfigError(f"{key} = {value!r} is not a data format: give one of {names}"
                              ) from None


@dataclass
class Data:
    """A job's data: training and held-out sequences, and the tokenizer that made them."""

    train: TokenSequences
    val: TokenSequences
    tokenizer: Tokenizer
    vocab_size: int


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
              block_size: int = 256) -> Data:
    """Read (or map) the data at `path`, split it, and cut it into sequences.

    Args:
        path: data.path: text file or folder (empty: the stdlib), JSONL file or folder,
            or token-shard folder.
        format: data.format: "text", "jsonl" or "tokens".
        tokenizer: data.tokenizer: "bytes" or a tokenizer.json (not used for "tokens").
        max_bytes: data.max_bytes: text read at most (not used for "tokens").
        val_fraction: the held-out share of the tokens, taken at the end.
        block_size: tokens per sequence.

    Raises:
        ConfigError: a bad format, tokenizer or path, no text, bad shards, or too few
            tokens for one sequence on each side; the message names the config key.
    """
    fmt = Format.parse(format)
    tokens: Tokens
    if fmt is Format.TOKENS:
        shards = TokenShards(path)
        tok = shards_tokenizer(path, shards.tokenizer, shards.vocab_size)
        if not len(shards):
            raise ConfigError(f"data.path {path!r} holds no tokens: run `dtrain data prepare` "
                              "again on a corpus with text")
        tokens = shards
    else:
        tok = load_tokenizer(tokenizer)
        documents = text_documents(path) if fmt is Format.TEXT else jsonl_documents(path)
        tokens = torch.from_numpy(encode_documents(documents, tok, max_bytes))
        if not len(tokens):
            raise ConfigError(f"data.path {path!r} holds no text")
    train, val = split(tokens, val_fraction, block_size)
    return Data(TokenSequences(train, block_size), TokenSequences(val, block_size), tok,
                tok.vocab_size)


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
