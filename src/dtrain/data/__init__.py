"""Training data: text, JSON lines or token shards, tokenizers, and `dtrain data prepare`.

    data = open_data("corpus/", format="text", tokenizer="bytes", max_bytes=4_000_000,
                     val_fraction=0.05, block_size=256)
    data.train[0]                       # (ids, next ids), int64 tensors of block_size

- `tokenizer.py`: "bytes" or a Hugging Face tokenizer.json (`load_tokenizer`).
- `corpus.py`: documents of text files, folders, JSONL or the stdlib; `encode_documents`.
- `shards.py`: the token-shard format (`ShardWriter`, `TokenShards`).
- `sequences.py`: `TokenSequences`, `split`, `batches` (the layout-independent order).
- `dataset.py`: `open_data` and `vocab_of` from a job's `[data]` config.
- `prepare.py`: `dtrain data prepare`, tokenizing in parallel into shards
  (`dtrain.data.prepare.prepare`; the module, not a name of the package).

Names are imported on first use, so the `dtrain` command starts without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Tokenizer": "dtrain.data.tokenizer",
    "load_tokenizer": "dtrain.data.tokenizer",
    "encode_documents": "dtrain.data.corpus",
    "jsonl_documents": "dtrain.data.corpus",
    "read_corpus": "dtrain.data.corpus",
    "text_documents": "dtrain.data.corpus",
    "ShardWriter": "dtrain.data.shards",
    "TokenShards": "dtrain.data.shards",
    "TokenSequences": "dtrain.data.sequences",
    "View": "dtrain.data.sequences",
    "batches": "dtrain.data.sequences",
    "split": "dtrain.data.sequences",
    "Data": "dtrain.data.dataset",
    "Format": "dtrain.data.formats",
    "open_data": "dtrain.data.dataset",
    "vocab_of": "dtrain.data.dataset",
}

__all__ = [
    "Data", "Format", "ShardWriter", "TokenSequences", "TokenShards", "Tokenizer", "View",
    "batches", "encode_documents", "jsonl_documents", "load_tokenizer", "open_data",
    "read_corpus", "split", "text_documents", "vocab_of",
]

if TYPE_CHECKING:
    from dtrain.data.corpus import encode_documents, jsonl_documents, read_corpus, text_documents
    from dtrain.data.dataset import Data, open_data, vocab_of
    from dtrain.data.formats import Format
    from dtrain.data.sequences import TokenSequences, View, batches, split
    from dtrain.data.shards import ShardWriter, TokenShards
    from dtrain.data.tokenizer import Tokenizer, load_tokenizer


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dtrain.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
