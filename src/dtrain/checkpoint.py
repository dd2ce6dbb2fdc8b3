"""Checkpoints that a crash cannot corrupt: temp file, fsync, rename, checksum.

A checkpoint is one file `step-00000200.pt` in the checkpoint folder. It is written to a
hidden temporary name, flushed to disk and renamed into place, so a reader sees the whole
file or none of it. `index.json` (also replaced atomically) lists the checkpoints with
their SHA-256; loading verifies it, so a damaged file is refused by name instead of
silently loading garbage.

A sharded checkpoint (dtrain.ZeRO: every rank holds a different part of the state) is a
folder `step-00000200/` with one file per rank, each written the same way; only when all
ranks have written theirs does the first rank add the folder to the index, so a crash
midway leaves the previous checkpoint as the newest one listed.
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

INDEX = "index.json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def read_index(folder: str | Path) -> list[dict[str, Any]]:
    """The checkpoints recorded in `folder`, oldest first (empty if there are none)."""
    index = Path(folder) / INDEX
    if not index.exists():
        return []
    try:
        return json.loads(index.read_text())["checkpoints"]
    except (ValueError, KeyError) as exc:
        raise DtrainError(f"checkpoint index {index} is damaged ({exc}): remove it") from None


def save(folder: str | Path, step: int, state: dict[str, Any], keep_last: int) -> Path:
    """Write `state` as the checkpoint of `step`, then drop all but the newest `keep_last`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:08d}.pt"
    _write_atomic(path, lambda f: torch.save(state, f))
    entries = [e for e in read_index(folder) if e["file"] != path.name]
    entries.append({"file": path.name, "step": step, "sha256": _sha256(path)})
    _replace_index(folder, entries, keep_last)
    return path


def _replace_index(folder: Path, entries: list[dict[str, Any]], keep_last: int) -> None:
    """Write the index with the newest `keep_last` entries, then delete the others' files."""
    kept, dropped = entries[-keep_last:], entries[:-keep_last]
    payload = json.dumps({"checkpoints": kept}, indent=2).encode()
    _write_atomic(folder / INDEX, lambda f: f.write(payload))
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
    if _sha256(path) != entry["sha256"]:
        raise DtrainError(f"checkpoint file {path} is corrupted (checksum mismatch)")
    if "shards" in entry:
        raise DtrainError(f"checkpoint {path} is sharded: load it with load_shards")
    return torch.load(path, map_location="cpu", weights_only=True)


def _shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def save_shards(folder: str | Path, step: int, state: dict[str, Any], keep_last: int,
                group: Any) -> Path:
    """Every rank of `group` writes its `state` into the folder of `step`; the group's
    first rank then records the folder, with each shard's SHA-256, in the index."""
    from dtrain import comm

    g = comm.resolve(group)
    folder = Path(folder)
    target = folder / f"step-{step:08d}"
    target.mkdir(parents=True, exist_ok=True)
    _write_atomic(target / _shard_name(g.rank), lambda f: torch.save(state, f))
    comm.barrier(group=g)
    if g.rank == 0:
        shards = {_shard_name(r): _sha256(target / _shard_name(r)) for r in range(g.size)}
        entries = [e for e in read_index(folder) if e["file"] != target.name]
        entries.append({"file": target.name, "step": step, "shards": shards})
        _replace_index(folder, entries, keep_last)
    comm.barrier(group=g)
    return target


def load_shards(folder: str | Path, step: int | None = None) -> list[dict[str, Any]]:
    """The states of every rank of the newest sharded checkpoint (or that of `step`),
    after verifying each shard's checksum.

    Raises:
        DtrainError: no sharded checkpoint exists, or a shard is missing or damaged.
    """
    folder = Path(folder)
    entries = [e for e in read_index(folder) if "shards" in e
               and (step is None or e["step"] == step)]
    if not entries:
        raise DtrainError(f"no sharded checkpoint{f' of step {step}' if step else ''} in "
                          f"{folder}")
    target = folder / entries[-1]["file"]
    states = []
    for name, digest in entries[-1]["shards"].items():
        path = target / name
        if not path.exists():
            raise DtrainError(f"checkpoint shard {path} is missing")
        if _sha256(path) != digest:
            raise DtrainError(f"checkpoint shard {path} is corrupted (checksum mismatch)")
        states.append(torch.load(path, map_location="cpu", weights_only=True))
    return states
