"""Text data for language modelling: a corpus read as bytes, cut into training sequences.

The default corpus is the Python standard library's own source code, which every Python
installation ships, so the demo needs no download. Any text file or folder works too.
The last `val_fraction` of the bytes is held out for evaluation.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import Dataset

from dtrain.errors import ConfigError


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def _read_files(files: list[Path], max_bytes: int, what: str) -> bytes:
    parts, total = [], 0
    for path in files:
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            if len(files) == 1:
                raise ConfigError(f"data.path {what!r} looks binary (NUL bytes): give a text file")
            continue  # a folder may hold a stray binary; skip it
        parts.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"\n".join(parts)[:max_bytes]


def read_corpus(path: str, max_bytes: int) -> bytes:
    """Read up to `max_bytes` of text from a file, a folder (recursively), or the stdlib.

    Raises:
        ConfigError: the path is missing, empty, or binary.
    """
    if not path:
        return _read_files(_stdlib_files(), max_bytes, "stdlib")
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"data.path {path!r} does not exist")
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    data = _read_files(files, max_bytes, path)
    if not data:
        raise ConfigError(f"data.path {path!r} holds no text")
    return data


class ByteSequences(Dataset):
    """Non-overlapping windows of `block_size` bytes, each with its next-byte targets."""

    def __init__(self, data: bytes, block_size: int) -> None:
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.block_size = block_size

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.block_size)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


def split(data: bytes, val_fraction: float, block_size: int) -> tuple[bytes, bytes]:
    """Split into (train, held-out) at the end; both must hold at least one sequence.

    Raises:
        ConfigError: the corpus is too small for the block size.
    """
    cut = len(data) - int(len(data) * val_fraction)
    train, val = data[:cut], data[cut:]
    for name, part in (("training", train), ("held-out", val)):
        if len(part) <= block_size:
            raise ConfigError(
                f"the corpus's {name} part has {len(part)} bytes, too few for "
                f"model.block_size = {block_size}: give more data or a smaller block size"
            )
    return train, val


def batches(
    dataset: Dataset, global_batch: int, dp_size: int, dp_rank: int, seed: int, shuffle: bool,
    accum: int = 1, start: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless micro-batches of this rank's share of each global batch, from step `start`.

    Every epoch draws one permutation (the same on every rank, from `seed` and the epoch)
    and cuts it into global batches of `global_batch` sequences, dropping the tail; each
    global batch is cut into `accum` micro-batches, and rank r of `dp_size` takes every
    dp_size-th sequence of each, starting at r. Step k's global batch is therefore the same
    set of sequences whatever the number of ranks, so a run resumed in another layout
    continues on the data it would have seen, and `start` skips to step `start` directly.

    Raises:
        ConfigError: the dataset holds less than one global batch.
    """
    per_epoch = len(dataset) // global_batch
    if per_epoch == 0:
        raise ConfigError(
            f"the data holds {len(dataset)} sequences, fewer than one global batch of "
            f"{global_batch}: give more data or a smaller train.batch_size"
        )
    micro = global_batch // accum
    step, order, epoch = start, None, -1
    while True:
        if step // per_epoch != epoch:
            epoch = step // per_epoch
            order = (torch.randperm(len(dataset), generator=torch.Generator().manual_seed(
                seed + epoch)) if shuffle else torch.arange(len(dataset)))
        base = (step % per_epoch) * global_batch
        for m in range(accum):
            window = order[base + m * micro : base + (m + 1) * micro][dp_rank::dp_size]
            xs, ys = zip(*(dataset[i] for i in window.tolist()), strict=True)
            yield torch.stack(xs), torch.stack(ys)
        step += 1
