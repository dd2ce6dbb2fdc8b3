"""`dtrain data prepare`: tokenize a corpus into token shards, in parallel, in constant memory.

    dtrain data prepare corpus/ more.jsonl shards/ --tokenizer tokenizer.json --workers 8
    dtrain data prepare chats.jsonl shards/ --format chat --tokenizer tok/tokenizer.json

Documents are read lazily (a text file whole, a JSONL file line by line), grouped into
chunks of about a MiB, encoded by a pool of processes and written back in their order, so
the shards hold exactly `encode_documents` of the same documents: their ids joined by the
tokenizer's separator, whatever the number of workers. At most two chunks per worker are
in flight, which bounds memory whatever the corpus's size. Where each document starts is
written beside the ids (documents.bin), so a run can pack them (dtrain.data.packing).

Chat and prompt/completion records (`--format`) are rendered and masked as training reads
them (dtrain.data.chat): their ids back to back, each record a document, with a target
flag per token beside the ids; a record with no target token is skipped and counted.
Preference records (`--format preference`, dtrain.data.preference) give two documents
each, the chosen row then the rejected one, kept or skipped together, and the index says
"pairs": training reads the shards as it reads the JSON lines.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Union

import numpy as np

from dtrain.errors import ConfigError
from dtrain.sizes import parse_size

if TYPE_CHECKING:
    from multiprocessing.pool import AsyncResult

    from dtrain.data.chat import ChatTemplate, TrainOn
    from dtrain.data.corpus import Document
    from dtrain.data.records import Kind
    from dtrain.data.tokenizer import Tokenizer

CHUNK_BYTES = 1 << 20
"""Text per chunk handed to a worker: large enough to amortize the hand-off."""
CHUNK_DOCUMENTS = 4096
IN_FLIGHT_PER_WORKER = 2
FORMATS = ("text", "chat", "prompt_completion", "preference")

Item = Union["Document", tuple[dict[str, object], str]]
"""What a chunk holds: text documents, or records with where they are."""


@dataclass
class Piece:
    """A chunk encoded: ids back to back, where each document starts in them (and the
    end), target flags (None for text), and what was dropped."""

    ids: np.ndarray
    starts: np.ndarray
    targets: np.ndarray | None
    skipped: int = 0
    truncated: int = 0


@dataclass
class Encoder:
    """How to encode a chunk, sent to every worker once: the tokenizer spec, and for
    records their kind, the chat template's text and tokens, train_on and max_length."""

    tokenizer: str
    kind: Kind | None = None
    template: tuple[str, str, str] | None = None
    train_on: TrainOn = "all"
    max_length: int = 0
    column: str = ""

    def open(self) -> tuple[Tokenizer, ChatTemplate | None]:
        from dtrain.data.chat import ChatTemplate
        from dtrain.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(self.tokenizer, key="--tokenizer")
        if self.template is None:
            return tokenizer, None
        source, bos, eos = self.template
        return tokenizer, ChatTemplate(source, bos, eos, origin="--chat-template")

    def encode(self, items: list[Item], opened: tuple[Tokenizer, ChatTemplate | None]
               ) -> Piece:
        from dtrain.data.corpus import encode_with_starts
        from dtrain.data.records import Encoded, encode_records, with_targets

        tokenizer, template = opened
        if self.kind is None:
            ids, starts = encode_with_starts(items, tokenizer)  # type: ignore[arg-type]
            return Piece(ids, starts, None)
        records = [item for item in items if isinstance(item, tuple)]  # records, by kind
        kept, skipped, truncated = with_targets(
            encode_records(records, self.kind, tokenizer, template, self.train_on, self.column),
            self.kind, self.max_length)
        joined = Encoded.join(kept, tokenizer.dtype)
        return Piece(joined.ids, joined.starts, joined.targets, skipped, truncated)


_worker: tuple[Encoder, tuple[Tokenizer, ChatTemplate | None]] | None = None


def _start_worker(encoder: Encoder) -> None:
    global _worker
    _worker = (encoder, encoder.open())


def _encode_chunk(items: list[Item]) -> Piece:
    assert _worker is not None  # set by _start_worker
    encoder, opened = _worker
    return encoder.encode(items, opened)


def _chunks(items: Iterable[tuple[Item | None, int]]) -> Iterator[tuple[list[Item], int]]:
    """Items grouped into chunks of about CHUNK_BYTES, each with its bytes read (a
    skipped file, None, counts its bytes only)."""
    chunk: list[Item] = []
    size = 0
    for item, nbytes in items:
        size += nbytes
        if item is None:
            continue
        chunk.append(item)
        if size >= CHUNK_BYTES or len(chunk) >= CHUNK_DOCUMENTS:
            yield chunk, size
            chunk, size = [], 0
    if chunk or size:
        yield chunk, size


def _encoded(chunks: Iterable[tuple[list[Item], int]], encoder: Encoder, workers: int,
             ) -> Iterator[tuple[Piece, int, int]]:
    """Each chunk encoded, with its items and bytes, in the chunks' order, by `workers`
    processes.

    Pool.imap would be the obvious call, but its feeder thread drains the input as fast as
    it can, holding the whole corpus in memory; apply_async with a bounded queue of
    pending results keeps the same order with at most IN_FLIGHT_PER_WORKER chunks per
    worker in flight.
    """
    if workers <= 1:
        opened = encoder.open()
        for items, nbytes in chunks:
            yield encoder.encode(items, opened), len(items), nbytes
        return
    # fork starts workers in milliseconds; they only tokenize, touching no torch state
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    with context.Pool(workers, initializer=_start_worker, initargs=(encoder,)) as pool:
        pending: deque[tuple[AsyncResult[Piece], int, int]] = deque()
        for items, nbytes in chunks:
            pending.append((pool.apply_async(_encode_chunk, (items,)), len(items), nbytes))
            if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                result, done, size = pending.popleft()
                yield result.get(), done, size
        while pending:
            result, done, size = pending.popleft()
            yield result.get(), done, size


def prepare(inputs: list[str], out: str, tokenizer: str = "bytes",
            shard_size: int = 100_000_000, workers: int = 0, dtype: str = "auto",
            progress: bool = True, format: str = "text", chat_template: str = "",
            train_on: str = "auto", max_length: int = 0, column: str = "",
            split: str = "train") -> dict[str, object]:
    """Tokenize text files, folders and JSONL files into a token-shard folder `out`.

    Text (`format` "text"): a file ending in .jsonl gives one document per line (its
    "text" field); any other file is one document (a binary file in a folder is
    skipped). Inputs are read in the order given, a folder's files recursively in sorted
    order. The shards hold the documents' ids joined by the tokenizer's separator,
    exactly as `encode_documents` gives them. Records (`format` "chat" or
    "prompt_completion"): each line of the .jsonl inputs a document, its ids and target
    flags as `dtrain train` would make them of the same file (dtrain.data.chat);
    "preference": each line two documents, its chosen and rejected rows
    (dtrain.data.preference), the index marked "pairs". A tokenizer file is copied into
    `out` as tokenizer.json.

    Args:
        inputs: files and folders to read.
        out: the folder to write (must not exist, or be empty); written atomically.
        tokenizer: "bytes" or the path of a Hugging Face tokenizer.json.
        shard_size: tokens per shard file.
        workers: encoding processes; 0 means one per CPU, 1 encodes in this process.
        dtype: auto (uint16 for at most 65,536 ids, else uint32), uint16 or uint32.
        progress: show a progress bar (bytes read) on stderr.
        format: text, chat, prompt_completion or preference.
        chat_template, train_on, column, split: as `[data]`'s keys of those names (an
            input may be a Hugging Face dataset folder or parquet files:
            dtrain.data.tables).
        max_length: cut records to this many tokens (0: keep them whole); a record (a
            pair) with a document left without a target is skipped.

    Returns:
        A summary: out, tokens, shards, documents, bytes, dtype, vocab_size, tokenizer,
        targets (target tokens), skipped (records without one), truncated.

    Raises:
        ConfigError: no inputs, an input missing or unreadable (or a binary file alone, or
            a bad JSON line or record), a bad tokenizer, template or dtype, an id that does
            not fit the dtype, no tokens at all, or `out` not empty. Nothing is then
            written at `out`.
    """
    from tqdm import tqdm

    from dtrain.data.chat import ChatTemplate
    from dtrain.data.corpus import corpus_files
    from dtrain.data.formats import Format, train_on_of
    from dtrain.data.preference import check_column
    from dtrain.data.records import Kind
    from dtrain.data.shards import ShardWriter
    from dtrain.data.tables import is_table

    if not inputs:
        raise ConfigError("no INPUT given: name the text files, folders or .jsonl files to "
                          "tokenize")
    if workers < 0:
        raise ConfigError(f"--workers {workers} must be 0 (one per CPU) or more")
    if format not in FORMATS:
        raise ConfigError(f"--format {format!r} is unknown: give {', '.join(FORMATS)}")
    workers = workers or os.cpu_count() or 1
    fmt = Format(format)
    pairs = fmt.records is Kind.PREFERENCE
    if pairs:
        check_column(column, "--column")
    encoder = Encoder(tokenizer, fmt.records, None, train_on_of(fmt, train_on, "--train-on"),
                      max_length, column)
    if fmt.records is not None:
        found = ChatTemplate.for_records(tokenizer, chat_template,
                                         required=fmt.records is Kind.CHAT)
        if found is not None:
            encoder.template = (found.source, found.bos_token, found.eos_token)
    tok, _ = encoder.open()
    listings = [(given, corpus_files(given, key="input")) for given in inputs]
    total = sum(file.stat().st_size for _, files in listings for file in files)
    tables = {given for given in inputs if is_table(given)}
    name = "bytes" if tok.path is None else Path(tok.path).name
    documents_read = bytes_read = targets = skipped = truncated = 0
    with (ShardWriter(out, tok.vocab_size, name, tok.path, shard_size, dtype,
                      targets=fmt.records is not None, pairs=pairs) as writer,
          tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
               desc="tokenizing", disable=not progress) as bar):
        chunks = _chunks(_text_items(listings, tables, column, split) if fmt.records is None
                         else _record_items(inputs, split))
        for piece, items, nbytes in _encoded(chunks, encoder, workers):
            if fmt.records is None and items and documents_read:  # as between documents
                writer.write(tok.separator)
            writer.start_documents(piece.starts[:-1])
            writer.write(piece.ids, piece.targets)
            documents_read += len(piece.starts) - 1
            skipped, truncated = skipped + piece.skipped, truncated + piece.truncated
            targets += len(piece.ids) if piece.targets is None else int(piece.targets.sum())
            bytes_read += nbytes
            bar.update(nbytes)
            bar.set_postfix_str(f"{writer.tokens:,} tokens", refresh=False)
        separators = max(documents_read - 1, 0) * len(tok.separator)
        if fmt.records is None and writer.tokens == separators:  # every document empty
            raise ConfigError(f"the inputs {', '.join(inputs)} hold no text: give files with "
                              "text, or JSONL lines with a non-empty \"text\" field")
        if fmt.records is not None and not documents_read:
            raise ConfigError(f"the inputs {', '.join(inputs)} hold no {format} record with a "
                              f"target token ({skipped} skipped): give records with assistant "
                              "turns or completions")
        index = writer.finish()
    return {"out": out, "tokens": index["tokens"], "shards": len(index["shards"]),
            "documents": documents_read, "bytes": bytes_read, "dtype": index["dtype"],
            "vocab_size": tok.vocab_size, "tokenizer": name, "targets": targets,
            "skipped": skipped, "truncated": truncated}


def _record_items(inputs: list[str], split: str) -> Iterator[tuple[Item | None, int]]:
    """The records of every input (.jsonl files and folders of them, or tables), with
    their sizes."""
    from dtrain.data.records import records

    for given in inputs:
        for record, where, nbytes in records(given, key="input", split=split):
            yield (record, where), nbytes


def _text_items(listings: list[tuple[str, list[Path]]], tables: set[str], column: str,
                split: str) -> Iterator[tuple[Item | None, int]]:
    """The text documents of every input: a table's rows' `column`, the files of the
    others (dtrain.data.corpus.input_documents)."""
    from dtrain.data.corpus import input_documents, table_documents

    for given, files in listings:
        if given in tables:
            yield from table_documents(given, column, split)
        else:
            yield from input_documents([(given, files)])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Define `dtrain data prepare`'s arguments on `parser`."""
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="text files, folders (read recursively), .jsonl files, or "
                             "Hugging Face datasets (save_to_disk folders, parquet files)")
    parser.add_argument("out", metavar="OUT",
                        help="the shard folder to write (must not exist, or be empty)")
    parser.add_argument("--tokenizer", default="bytes", metavar="T",
                        help="bytes (default: one token per byte) or the path of a Hugging "
                             "Face tokenizer.json")
    parser.add_argument("--shard-size", default="100000000", metavar="N",
                        help="tokens per shard file (default 100000000; 100M = 100 x 2**20, "
                             "100MB = 100 x 10**6)")
    parser.add_argument("--workers", type=int, default=0, metavar="W",
                        help="encoding processes (default 0: one per CPU)")
    parser.add_argument("--format", choices=FORMATS, default="text",
                        help="text (default: text files and JSONL \"text\" lines), chat "
                             "(JSONL \"messages\"), prompt_completion (JSONL \"prompt\" "
                             "and \"completion\"), or preference (JSONL \"prompt\", "
                             "\"chosen\" and \"rejected\": two rows a pair)")
    parser.add_argument("--chat-template", default="", metavar="T",
                        help="a .jinja file or template text (default: the tokenizer's own)")
    parser.add_argument("--train-on", choices=("auto", "assistant", "completion", "all"),
                        default="auto", help="which tokens of a record are targets (default "
                        "auto: assistant turns for chat, the completion for pairs, the "
                        "responses for preference)")
    parser.add_argument("--max-length", type=int, default=0, metavar="N",
                        help="cut records to N tokens (default 0: keep them whole)")
    parser.add_argument("--column", default="", metavar="C",
                        help="the field of a JSON line or a dataset's row holding the text "
                             "or the conversation (default: text, or messages for chat)")
    parser.add_argument("--split", default="train", metavar="S",
                        help="the split of a saved Hugging Face dataset (default train)")
    parser.add_argument("--dtype", choices=("auto", "uint16", "uint32"), default="auto",
                        help="token dtype of the shards (default auto: uint16 up to 65,536 "
                             "ids, else uint32)")


def run(args: argparse.Namespace) -> None:
    """Run `dtrain data prepare` from its parsed arguments and print a summary line.

    Raises:
        ConfigError: see `prepare`, or a --shard-size that is not a count of tokens.
    """
    try:
        shard_size = parse_size(args.shard_size, "--shard-size")
    except ConfigError:
        raise ConfigError(f"--shard-size {args.shard_size!r} is not a count of tokens: give "
                          "a number like 100000000, 100M (x 2**20) or 100MB (x 10**6)"
                          ) from None
    summary = prepare(args.inputs, args.out, args.tokenizer, shard_size, args.workers,
                      args.dtype, progress=sys.stderr.isatty(), format=args.format,
                      chat_template=args.chat_template, train_on=args.train_on,
                      max_length=args.max_length, column=args.column, split=args.split)
    print(f"dtrain: wrote {summary['tokens']:,} tokens of {summary['documents']:,} documents "
          f"in {summary['shards']} {summary['dtype']} shards to {summary['out']} (tokenizer "
          f"{summary['tokenizer']}, vocabulary {summary['vocab_size']:,})")
    if args.format != "text":
        print(f"dtrain: {summary['targets']:,} target tokens; {summary['skipped']:,} records "
              f"without a target skipped; {summary['truncated']:,} cut to --max-length")
