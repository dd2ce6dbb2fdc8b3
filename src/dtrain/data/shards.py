"""Token shards: a tokenized corpus on disk, written once and read lazily.

A folder of `.bin` files, each raw little-endian token ids (uint16, or uint32 when the
vocabulary has more than 65,536 ids), and `index.json`:

    {"format": "dtrain.tokens/1", "dtype": "uint16", "vocab_size": 50257,
     "tokenizer": "tokenizer.json", "tokens": 1234567,
     "shards": [{"file": "shard-00000.bin", "tokens": 1000000}, ...],
     "documents": 5120, "targets": true}

"tokenizer" is "bytes" or the name of the tokenizer file, which the folder then holds as
`tokenizer.json`. "documents" (when present) counts the documents whose starts
`documents.bin` holds (uint64 offsets into the token stream, one per document and one past
the end); "targets" true means each shard has a `targets-NNNNN.bin` beside it, one byte
per token, 1 where the token is a target of the loss (chat data's assistant turns).
"pairs" true (written only then) means the documents are preference pairs: document 2i
a pair's chosen row, 2i+1 its rejected row (`dtrain data prepare --format preference`).

`ShardWriter` writes a folder atomically (into a temporary folder beside it, renamed into
place at the end); `TokenShards` memory-maps each shard on first use, so reading a window
touches only the pages it needs.
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
import tempfile
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, BinaryIO, NotRequired, TypedDict, overload

import numpy as np

from dtrain.errors import ConfigError

if TYPE_CHECKING:
    import torch

FORMAT = "dtrain.tokens/1"
INDEX = "index.json"
TOKENIZER_FILE = "tokenizer.json"
DTYPES: dict[str, np.dtype[np.unsignedinteger]] = {"uint16": np.dtype("<u2"),
                                                   "uint32": np.dtype("<u4")}
DOCUMENTS = "documents.bin"
STARTS = np.dtype("<u8")
FLAGS = np.dtype("u1")
AGAIN = "run `dtrain data prepare` again"


class ShardEntry(TypedDict):
    """One shard of the index: its file and how many tokens it holds."""

    file: str
    tokens: int


class ShardIndex(TypedDict):
    """The index a ShardWriter writes (index.json)."""

    format: str
    dtype: str
    vocab_size: int
    tokenizer: str
    tokens: int
    shards: list[ShardEntry]
    documents: int
    targets: bool
    pairs: NotRequired[bool]


def targets_file(shard: str) -> str:
    """The name of the target flags beside shard file `shard`."""
    return shard.replace("shard-", "targets-", 1)


def choose_dtype(vocab_size: int, dtype: str = "auto") -> str:
    """The shard dtype: `dtype` if "uint16" or "uint32", else (auto) the smallest that
    holds every id below `vocab_size`.

    Raises:
        ConfigError: `dtype` is none of auto, uint16, uint32.
    """
    if dtype == "auto":
        return "uint16" if vocab_size <= 1 << 16 else "uint32"
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not a token dtype: give auto, uint16 or uint32")
    return dtype


class ShardWriter:
    """Writes token ids into shards of `shard_size` tokens, atomically.

    Ids go straight to the open shard file, so memory stays constant; with `targets`,
    each write gives the ids' target flags too, written beside them. Document starts
    (`documents`) go to documents.bin as they come. The folder is built
    as a hidden temporary folder beside `out` and renamed to `out` by `finish()`; leaving
    the `with` block without `finish()` (an error) removes it, so nothing is left at `out`.

    Use:
        with ShardWriter(out, vocab_size) as writer:
            writer.write(ids)
            index = writer.finish()
    """

    def __init__(self, out: str, vocab_size: int, tokenizer: str = "bytes",
                 tokenizer_file: str | None = None, shard_size: int = 100_000_000,
                 dtype: str = "auto", key: str = "OUT", targets: bool = False,
                 pairs: bool = False) -> None:
        """Check `out` and open the temporary folder.

        Args:
            out: the folder to write; it must not exist or be empty.
            vocab_size: the tokenizer's vocabulary, recorded in the index.
            tokenizer: "bytes" or the tokenizer file's name, recorded in the index.
            tokenizer_file: a tokenizer.json to copy into the folder.
            shard_size: tokens per shard file (the last one holds the rest).
            dtype: auto, uint16 or uint32 (see `choose_dtype`).
            key: what `out` is called in messages.
            targets: every write gives target flags (a loss mask) with its ids.
            pairs: the documents are preference pairs (2i chosen, 2i+1 rejected).

        Raises:
            ConfigError: `out` exists and is not an empty folder, or a bad dtype.
        """
        if shard_size < 1:
            raise ConfigError(f"--shard-size {shard_size} must be at least 1 token")
        self.out = Path(out)
        if self.out.exists() and (not self.out.is_dir() or any(self.out.iterdir())):
            raise ConfigError(f"{key} {out!r} exists and is not empty: remove it or choose "
                              "another folder")
        self.dtype = choose_dtype(vocab_size, dtype)
        self._limit = np.iinfo(DTYPES[self.dtype]).max
        self.vocab_size, self.tokenizer, self.shard_size = vocab_size, tokenizer, shard_size
        self.tokens = 0
        self.shards: list[ShardEntry] = []
        self.targets, self.documents, self.pairs = targets, 0, pairs
        self._file: BinaryIO | None = None
        self._flags: BinaryIO | None = None
        self._finished = False
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", suffix=".tmp",
                                          dir=self.out.parent))
        if tokenizer_file is not None:
            shutil.copyfile(tokenizer_file, self._tmp / TOKENIZER_FILE)
        self._starts = open(self._tmp / DOCUMENTS, "wb")  # closed by _close_shard's caller

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if not self._finished:
            self.abort()

    def start_documents(self, starts: np.ndarray) -> None:
        """Documents start at these offsets of the ids written next (0: the next id)."""
        (np.asarray(starts, dtype=np.int64) + self.tokens).astype(STARTS).tofile(self._starts)
        self.documents += len(starts)

    def write(self, ids: np.ndarray | list[int], targets: np.ndarray | None = None) -> None:
        """Append token ids (and their target flags, when the writer keeps them),
        starting new shards as they fill.

        Raises:
            ConfigError: an id is negative or does not fit the dtype.
        """
        if self.targets != (targets is not None):
            raise ValueError("target flags are given with every write or with none")
        flags = None if targets is None else np.asarray(targets, dtype=FLAGS)
        array = np.asarray(ids)
        if array.size == 0:
            return
        low, high = int(array.min()), int(array.max())
        if low < 0 or high > self._limit:
            bad = low if low < 0 else high
            fix = ("give --dtype uint32" if self.dtype == "uint16" and bad > 0
                   and bad < 1 << 32 else "the tokenizer's ids must lie in 0 .. 2**32 - 1")
            raise ConfigError(f"token id {bad} does not fit the shards' dtype {self.dtype}: "
                              f"{fix}")
        array = array.astype(DTYPES[self.dtype], copy=False)
        while array.size:
            if self._file is None:
                name = f"shard-{len(self.shards):05d}.bin"
                self._file = open(self._tmp / name, "wb")  # closed by _close_shard
                if flags is not None:
                    self._flags = open(self._tmp / targets_file(name), "wb")
                self.shards.append({"file": name, "tokens": 0})
            shard = self.shards[-1]
            take = array[: self.shard_size - shard["tokens"]]
            take.tofile(self._file)
            if flags is not None and self._flags is not None:
                flags[: take.size].tofile(self._flags)
                flags = flags[take.size :]
            shard["tokens"] += take.size
            self.tokens += take.size
            array = array[take.size :]
            if shard["tokens"] == self.shard_size:
                self._close_shard()

    def _close_shard(self) -> None:
        for file in (self._file, self._flags):
            if file is not None:
                file.close()
        self._file = self._flags = None

    def finish(self) -> ShardIndex:
        """Write the index and rename the folder into place; return the index.

        Raises:
            ConfigError: `out` appeared meanwhile and is not empty.
        """
        self._close_shard()
        np.asarray([self.tokens], dtype=STARTS).tofile(self._starts)  # one past the end
        self._starts.close()
        index: ShardIndex = {"format": FORMAT, "dtype": self.dtype, "vocab_size": self.vocab_size,
                 "tokenizer": self.tokenizer, "tokens": self.tokens, "shards": self.shards,
                 "documents": self.documents, "targets": self.targets}
        if self.pairs:
            index["pairs"] = True
        (self._tmp / INDEX).write_text(json.dumps(index, indent=1) + "\n")
        try:
            os.rename(self._tmp, self.out)  # replaces an empty folder, atomically
        except OSError as exc:
            self.abort()
            raise ConfigError(f"OUT {str(self.out)!r} cannot be written ({exc.strerror}): "
                              "remove it or choose another folder") from exc
        self._finished = True
        return index

    def abort(self) -> None:
        """Remove the temporary folder: nothing is written at `out`."""
        self._close_shard()
        self._starts.close()
        shutil.rmtree(self._tmp, ignore_errors=True)


def read_index(path: str, key: str = "data.path") -> dict[str, Any]:
    """The checked `index.json` of a token-shard folder (the shard files are not opened).

    Raises:
        ConfigError: the folder or its index is missing, unparseable, of another format,
            of an unknown dtype, or malformed.
    """
    folder = Path(path)
    where = f"{key} {path!r}"
    if not path or not folder.is_dir():
        state = "is empty" if not path else "is not a folder"
        raise ConfigError(f'{where} {state}: data.format = "tokens" needs a folder written '
                          "by `dtrain data prepare`")
    file = folder / INDEX
    if not file.is_file():
        raise ConfigError(f"{where} holds no {INDEX}: give a folder written by `dtrain data "
                          'prepare` (or set data.format = "text" or "jsonl")')
    try:
        index = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{where}: {INDEX} cannot be read ({exc}): {AGAIN}") from exc
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        found = index.get("format") if isinstance(index, dict) else None
        raise ConfigError(f"{where}: {INDEX} is not a dtrain token index (format {found!r}, "
                          f"expected {FORMAT!r}): {AGAIN}")
    if index.get("dtype") not in DTYPES:
        raise ConfigError(f"{where}: {INDEX} names dtype {index.get('dtype')!r}, not uint16 or "
                          f"uint32: {AGAIN}")
    shards = index.get("shards")
    well_formed = (
        isinstance(index.get("vocab_size"), int) and index["vocab_size"] > 0
        and isinstance(index.get("tokenizer"), str) and isinstance(shards, list)
        and all(isinstance(s, dict) and isinstance(s.get("file"), str)
                and isinstance(s.get("tokens"), int) and s["tokens"] >= 0 for s in shards)
        and index.get("tokens") == sum(s["tokens"] for s in shards)
        and isinstance(index.get("documents", 0), int) and index.get("documents", 0) >= 0
        and isinstance(index.get("targets", False), bool)
        and isinstance(index.get("pairs", False), bool))
    if not well_formed:
        raise ConfigError(f"{where}: {INDEX} is malformed (vocab_size, tokenizer, tokens or "
                          f"shards missing or inconsistent): {AGAIN}")
    return index


class MappedStream:
    """Files of raw values of one dtype as one sliceable sequence, each file memory-mapped
    on first use: `stream[a:b]` is an int64 tensor of values a..b-1, read from only the
    files that window crosses."""

    def __init__(self, files: list[Path], counts: list[int], dtype: np.dtype) -> None:
        self.dtype = dtype
        self._files: list[Path] = []
        self._starts: list[int] = []
        total = 0
        for file, count in zip(files, counts, strict=True):
            if count:  # an empty file cannot be memory-mapped, and holds nothing
                self._files.append(file)
                self._starts.append(total)
                total += count
        self._length = total
        self._maps: list[np.memmap | None] = [None] * len(self._files)

    def __len__(self) -> int:
        return self._length

    def _map(self, i: int) -> np.memmap:
        mapped = self._maps[i]
        if mapped is None:
            mapped = self._maps[i] = np.memmap(self._files[i], dtype=self.dtype, mode="r")
        return mapped

    @overload
    def __getitem__(self, index: slice) -> torch.Tensor: ...
    @overload
    def __getitem__(self, index: int) -> int: ...

    def __getitem__(self, index: slice | int) -> torch.Tensor | int:
        """Values `index` (a slice with step 1) as an int64 tensor, or one as an int."""
        import torch  # here: writing shards (dtrain data prepare) never loads torch

        if isinstance(index, int):
            position = index + self._length if index < 0 else index
            if not 0 <= position < self._length:
                raise IndexError(f"token {index} out of range for {self._length} tokens")
            return int(self[position : position + 1][0])
        start, stop, step = index.indices(self._length)
        if step != 1:
            raise ValueError("token shards are sliced with step 1 only")
        pieces = []
        shard = bisect.bisect_right(self._starts, start) - 1
        while start < stop:
            offset = start - self._starts[shard]
            piece = self._map(shard)[offset : offset + stop - start]
            pieces.append(piece.astype(np.int64))
            start += piece.size
            shard += 1
        if not pieces:
            return torch.zeros(0, dtype=torch.long)
        return torch.from_numpy(np.concatenate(pieces) if len(pieces) > 1 else pieces[0])


class TokenShards(MappedStream):
    """The token ids of a shard folder as one sliceable sequence, read lazily (a
    `MappedStream`); its target flags (`targets`, another, or None when every token is a
    target) and its documents' starts (`document_starts()`, None for a folder written
    before they were kept)."""

    def __init__(self, path: str, key: str = "data.path") -> None:
        """Read the index and check every shard file's size (no shard is read).

        Raises:
            ConfigError: a bad index (see `read_index`), a missing shard file, or one whose
                size is not its tokens times the dtype's size (truncated).
        """
        self.path, self.key = path, key
        self.index = read_index(path, key)
        self.vocab_size: int = self.index["vocab_size"]
        self.tokenizer: str = self.index["tokenizer"]
        self.pairs: bool = self.index.get("pairs", False)
        """The documents are preference pairs: 2i chosen, 2i+1 rejected."""
        names = [shard["file"] for shard in self.index["shards"]]
        counts = [shard["tokens"] for shard in self.index["shards"]]
        dtype = DTYPES[self.index["dtype"]]
        super().__init__(self._checked(names, counts, dtype), counts, dtype)
        self.targets: MappedStream | None = None
        if self.index.get("targets", False):
            flags = self._checked([targets_file(n) for n in names], counts, FLAGS)
            self.targets = MappedStream(flags, counts, FLAGS)

    def _checked(self, names: list[str], counts: list[int], dtype: np.dtype) -> list[Path]:
        files = []
        for name, count in zip(names, counts, strict=True):
            file = Path(self.path) / name
            expected = count * dtype.itemsize
            if not file.is_file():
                raise ConfigError(f"{self.key} {self.path!r}: shard {name} is missing: {AGAIN}")
            size = file.stat().st_size
            if size != expected:
                raise ConfigError(
                    f"{self.key} {self.path!r}: shard {name} has {size} bytes, not {count} "
                    f"tokens x {dtype.itemsize} = {expected} (truncated or damaged): {AGAIN}")
            files.append(file)
        return files

    def document_starts(self) -> np.ndarray | None:
        """Where each document starts, and one past the last (int64); None when the
        folder does not say.

        Raises:
            ConfigError: documents.bin is missing or of the wrong size.
        """
        count = self.index.get("documents", 0)
        if not count:
            return None
        (file,) = self._checked([DOCUMENTS], [count + 1], STARTS)
        return np.fromfile(file, dtype=STARTS).astype(np.int64)
