"""The `[data]` section: what `dtrain train` reads, and how it tokenizes it.

    [data]  path = "corpus/", format = "text", tokenizer = "bytes"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dtrain.errors import ConfigError
from dtrain.schema import positive


@dataclass
class DataConfig:
    path: str = ""
    """A text file or a folder of them, a JSON-lines file or folder (format = "jsonl"), or
    a folder of token shards (format = "tokens"); empty means the Python standard
    library's .py files."""
    format: Literal["text", "jsonl", "tokens"] = "text"
    """text (files read whole), jsonl (a "text" field per line) or tokens (shards written
    by `dtrain data prepare`: memory-mapped, read lazily)."""
    tokenizer: str = "bytes"
    """bytes (one token per byte, 256 ids) or the path of a Hugging Face tokenizer.json;
    with format = "tokens" the shards' own index names it."""
    max_bytes: int = positive(4_000_000)
    """Read at most this many bytes of the corpus."""
    val_fraction: float = 0.05
    """Share of the corpus held out for evaluation (its end)."""

    def check(self) -> None:
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"data.val_fraction = {self.val_fraction} must be between 0 "
                              "and 1 (the held-out share of the corpus)")
