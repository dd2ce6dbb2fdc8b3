"""Checkpoints that a crash cannot corrupt: temp file, fsync, rename, checksum.

A checkpoint is one file `step-00000200.pt` in the checkpoint folder. It is written to a
hidden temporary name, flushed to disk and renamed into place, so a reader sees the whole
file or none of it. `index.json` (also replaced atomically) lists the checkpoints with
their SHA-256; loading verifies it, so a damaged file is refused by name instead of
silently loading garbage.

The same index lists the folders of universal checkpoints (dtrain.checkpoint.universal), which every
rank of a run writes together.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from dtrain.errors import DtrainError

CHECKPOINTS_INDEX = "index.json"


def sha256(path: Path) -> str:
    """The file's SHA-256, hex."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync(path: Path) -> None:
    """Flush a file or folder (its entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write) -> None:
    """Write `path` through `write(binary file)`: a temporary file, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync(path.parent)


def read_index(folder: str | Path) -> list[dict[str, Any]]:
    """The checkpoints recorded in `folder`, oldest first (empty if there are none)."""
    index = Path(folder) / CHECKPOINTS_INDEX
    if not index.exists():
        return []
    try:
        entries = json.loads(index.read_text())["checkpoints"]
        if not all(isinstance(e, dict) for e in entries):
            raise ValueError("an entry is not an object")
        return entries
    except (ValueError, KeyError, TypeError) as exc:
        raise DtrainError(f"checkpoint index {index} is damaged ({exc}): remove it") from None


def save(folder: str | Path, step: int, state: dict[str, Any], keep_last: int) -> Path:
    """Write `state` as the checkpoint of `step`, then drop all but the newest `keep_last`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:08d}.pt"
    write_atomic(path, lambda f: torch.save(state, f))
    entries = [e for e in read_index(folder) if e["file"] != path.name]
    entries.append({"file": path.name, "step": step, "sha256": sha256(path)})
    replace_index(folder, entries, keep_last)
    return path


def replace_index(folder: Path, entries: list[dict[str, Any]], keep_last: int) -> None:
    """Write the index with the newest `keep_last` entries, then delete the others' files."""
    kept, dropped = entries[-keep_last:], entries[:-keep_last]
    payload = json.dumps({"checkpoints": kept}, indent=2).encode()
    write_atomic(folder / CHECKPOINTS_INDEX, lambda f: f.write(payload))
    for entry in dropped:
        path = folder / entry["file"]
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def load(folder: str | Path, step: int | None = None) -> dict[str, Any]:
    """Load the newest checkpoint (or the one of `step`) after verifying its checksum.

    Raises:
        DtrainError: no checkpoint exists, or its file is missing or does not match its checksum.
    """
    folder = Path(folder)
    entries = read_index(folder)
    if step is not None:
        entries = [e for e in entries if e["step"] == step]
    if not entries:
        raise DtrainError(f"no checkpoint{f' of step {step}' if step else ''} in {folder}")
    entry = entries[-1]
    path = folder / entry["file"]
    if not path.exists():
        raise DtrainError(f"checkpoint file {path} is missing")
    if sha256(path) != entry["sha256"]:
        raise DtrainError(f"checkpoint file {path} is corrupted (checksum mismatch)")
    if path.is_dir():
        raise DtrainError(f"checkpoint {path} is a universal checkpoint: open it with "
                          "dtrain.checkpoint.universal.Checkpoint")
    return torch.load(path, map_location="cpu", weights_only=True)

