"""`dtrain data prepare`: tokenize a corpus into token shards, in parallel, in constant memory.

    dtrain data prepare corpus/ more.jsonl shards/ --tokenizer tokenizer.json --workers 8

Documents are read lazily (a text file whole, a JSONL file line by line), grouped into
chunks of about a MiB, encoded by a pool of processes and written back in their order, so
the shards hold exactly `encode_documents` of the same documents: their ids joined by the
tokenizer's separator, whatever the number of workers. At most two chunks per worker are
in flight, which bounds memory whatever the corpus's size.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from dtrain.errors import ConfigError
from dtrain.sizes import parse_size

if TYPE_CHECKING:
    from multiprocessing.pool import AsyncResult

    import numpy as np

    from dtrain.data.corpus import Document
    from dtrain.data.tokenizer import Tokenizer

CHUNK_BYTES = 1 << 20
"""Text per chunk handed to a worker: large enough to amortize the hand-off."""
CHUNK_DOCUMENTS = 4096
IN_FLIGHT_PER_WORKER = 2

_worker_tokenizer: Tokenizer | None = None


def _start_worker(spec: str) -> None:
    global _worker_tokenizer
    from dtrain.data.tokenizer import load_tokenizer

    _worker_tokenizer = load_tokenizer(spec)


def _encode_chunk(documents: list[Document], tokenizer: Tokenizer | None = None) -> np.ndarray:
    """The ids of `documents` joined by the separator (none before the first)."""
    from dtrain.data.corpus import encode_documents

    tok = tokenizer or _worker_tokenizer
    assert tok is not None  # given, or this worker's (set by _start_worker)
    return encode_documents(documents, tok)


def _chunks(documents: Iterable[tuple[Document | None, int]],
            ) -> Iterator[tuple[list[Document], int]]:
    """Documents grouped into chunks of about CHUNK_BYTES, each with its bytes read (a
    skipped file, None, counts its bytes only)."""
    chunk: list[Document] = []
    size = 0
    for document, nbytes in documents:
        size += nbytes
        if document is None:
            continue
        chunk.append(document)
        if size >= CHUNK_BYTES or len(chunk) >= CHUNK_DOCUMENTS:
            yield chunk, size
            chunk, size = [], 0
    if chunk or size:
        yield chunk, size


def _encoded(chunks: Iterable[tuple[list[Document], int]], spec: str, workers: int,
             ) -> Iterator[tuple[np.ndarray, int, int]]:
    """Each chunk's ids, documents and bytes, in the chunks' order, encoded by `workers`
    processes.

    Pool.imap would be the obvious call, but its feeder thread drains the input as fast as
    it can, holding the whole corpus in memory; apply_async with a bounded queue of
    pending results keeps the same order with at most IN_FLIGHT_PER_WORKER chunks per
    worker in flight.
    """
    if workers <= 1:
        from dtrain.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(spec)
        for documents, nbytes in chunks:
            yield _encode_chunk(documents, tokenizer), len(documents), nbytes
        return
    # fork starts workers in milliseconds; they only tokenize, touching no torch state
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    with context.Pool(workers, initializer=_start_worker, initargs=(spec,)) as pool:
        pending: deque[tuple[AsyncResult[np.ndarray], int, int]] = deque()
        for documents, nbytes in chunks:
            pending.append((pool.apply_async(_encode_chunk, (documents,)), len(documents),
                            nbytes))
            if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                result, done, size = pending.popleft()
                yield result.get(), done, size
        while pending:
            result, done, size = pending.popleft()
            yield result.get(), done, size


def prepare(inputs: list[str], out: str, tokenizer: str = "bytes",
            shard_size: int = 100_000_000, workers: int = 0, dtype: str = "auto",
            progress: bool = True) -> dict[str, object]:
    """Tokenize text files, folders and JSONL files into a token-shard folder `out`.

    A file ending in .jsonl gives one document per line (its "text" field); any other
    file is one document (a binary file in a folder is skipped). Inputs are read in the
    order given, a folder's files recursively in sorted order. The shards hold the
    documents' ids joined by the tokenizer's separator, exactly as `encode_documents`
    gives them; a tokenizer file is copied into `out` as tokenizer.json.

    Args:
        inputs: files and folders to read.
        out: the folder to write (must not exist, or be empty); written atomically.
        tokenizer: "bytes" or the path of a Hugging Face tokenizer.json.
        shard_size: tokens per shard file.
        workers: encoding processes; 0 means one per CPU, 1 encodes in this process.
        dtype: auto (uint16 for at most 65,536 ids, else uint32), uint16 or uint32.
        progress: show a progress bar (bytes read) on stderr.

    Returns:
        A summary: out, tokens, shards, documents, bytes, dtype, vocab_size, tokenizer.

    Raises:
        ConfigError: no inputs, an input missing or unreadable (or a binary file alone, or
            a bad JSON line), a bad tokenizer or dtype, an id that does not fit the dtype,
            no tokens at all, or `out` not empty. Nothing is then written at `out`.
    """
    from tqdm import tqdm

    from dtrain.data.corpus import corpus_files, input_documents
    from dtrain.data.shards import ShardWriter
    from dtrain.data.tokenizer import load_tokenizer

    if not inputs:
        raise ConfigError("no INPUT given: name the text files, folders or .jsonl files to "
                          "tokenize")
    if workers < 0:
        raise ConfigError(f"--workers {workers} must be 0 (one per CPU) or more")
    workers = workers or os.cpu_count() or 1
    tok = load_tokenizer(tokenizer, key="--tokenizer")
    listings = [(given, corpus_files(given, key="input")) for given in inputs]
    total = sum(file.stat().st_size for _, files in listings for file in files)
    name = "bytes" if tok.path is None else Path(tok.path).name
    documents_read = bytes_read = 0
    with (ShardWriter(out, tok.vocab_size, name, tok.path, shard_size, dtype) as writer,
          tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
               desc="tokenizing", disable=not progress) as bar):
        chunks = _chunks(input_documents(listings))
        for ids, documents, nbytes in _encoded(chunks, tokenizer, workers):
            if documents and documents_read:  # between chunks, as between documents
                writer.write(tok.separator)
            writer.write(ids)
            documents_read += documents
            bytes_read += nbytes
            bar.update(nbytes)
            bar.set_postfix_str(f"{writer.tokens:,} tokens", refresh=False)
        separators = max(documents_read - 1, 0) * len(tok.separator)
        if writer.tokens == separators:  # every document empty
            raise ConfigError(f"the inputs {', '.join(inputs)} hold no text: give files with "
                              "text, or JSONL lines with a non-empty \"text\" field")
        index = writer.finish()
    return {"out": out, "tokens": index["tokens"], "shards": len(index["shards"]),
            "documents": documents_read, "bytes": bytes_read, "dtype": index["dtype"],
            "vocab_size": tok.vocab_size, "tokenizer": name}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Define `dtrain data prepare`'s arguments on `parser`."""
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="text files, folders (read recursively) or .jsonl files")
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
                      args.dtype, progress=sys.stderr.isatty())
    print(f"dtrain: wrote {summary['tokens']:,} tokens of {summary['documents']:,} documents "
          f"in {summary['shards']} {summary['dtype']} shards to {summary['out']} (tokenizer "
          f"{summary['tokenizer']}, vocabulary {summary['vocab_size']:,})")
