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
    """A text file or a folder of them, a JSON-lines file or folder (formats jsonl, chat,
    prompt_completion, preference), or a folder of token shards (format = "tokens"); empty
    means the Python standard library's .py files."""
    format: Literal["text", "jsonl", "chat", "prompt_completion", "preference", "tokens"] = (
        "text")
    """text (files read whole), jsonl (a "text" field per line), chat (a "messages" list
    per line, rendered by the chat template), prompt_completion ("prompt" and
    "completion" fields per line), preference ("prompt", "chosen" and "rejected" per line,
    for DPO: two padded rows a pair, chosen then rejected) or tokens (shards written by
    `dtrain data prepare`: memory-mapped, read lazily)."""
    packing: Literal["auto", "stream", "block_causal", "pad"] = "auto"
    """How documents become rows: stream (joined, cut into windows, attending across
    documents), block_causal (whole documents packed into rows, none seeing another,
    positions from 0 in each), pad (one document per row, padded); auto streams text,
    packs chat, prompt_completion and shards with loss masks (block_causal) and pads
    preference pairs (the only packing they take)."""
    train_on: Literal["auto", "assistant", "completion", "all"] = "auto"
    """Which tokens are targets of the loss: assistant (every assistant turn of a
    conversation), completion (a conversation's last assistant turn, or a pair's
    completion), all; auto is assistant for chat, completion for prompt_completion and
    preference (its responses: nothing else), all for text."""
    too_long: Literal["auto", "split", "truncate", "refuse"] = "auto"
    """A document longer than model.block_size when packed: split into rows, truncate, or
    refuse; auto splits text and truncates records and shards with loss masks (a
    preference row loses its response's end; split is refused for pairs)."""
    column: str = ""
    """The field of a JSON line or a dataset's row that holds the text (jsonl) or the
    conversation (chat); empty: "text" and "messages". Not for preference data (its
    fields are prompt, chosen and rejected)."""
    split: str = "train"
    """The split of a saved Hugging Face dataset with several (dataset_dict.json)."""
    chat_template: str = ""
    """The chat template (a .jinja file or the template itself); empty: the tokenizer's
    own, from the tokenizer_config.json or chat_template.jinja beside its tokenizer.json."""
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
