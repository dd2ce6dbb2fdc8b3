"""Files and JSON between ranks over a process group: checkpoint copies from host to host.

    send_file(path, dst, group)                 # on the rank that has the file
    recv_file(path, src, group, sha256)         # on the rank that wants it: written atomically
    every = all_gather_json(value, group)       # each rank's JSON value, in rank order

A file goes as its size (one int64), then its bytes in messages of at most CHUNK bytes
(one file never sits whole in memory), then its SHA-256 as computed while it was read.
The receiver hashes what it writes to a hidden temporary file and renames it into place
only when both digests, and the one the checkpoint's index lists, agree; otherwise the
temporary goes and the call raises. Bytes are raw uint8 tensors and JSON: nothing
received is ever unpickled. A receiver that cannot write still takes every message, so
the two ranks stay in step and the next transfer is not mixed up with this one.

The messages are dtrain.comm's `send`/`recv`, with the group's timeout: a peer that never
sends fails the wait with its rank named.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TypeAlias, TypeVar

import torch

from dtrain import comm
from dtrain.checkpoint import atomic
from dtrain.errors import DtrainError

CHUNK = 16 << 20
"""The largest message of a file transfer (bytes): what a transfer holds in memory."""

JSON: TypeAlias = "dict[str, object] | list[object] | str | int | float | bool | None"
_J = TypeVar("_J", bound=JSON)  # every rank's value is of the same kind


def send_file(path: Path, dst: int, group: comm.Group) -> int:
    """Send the file `path` to group rank `dst` (which calls `recv_file`); returns the bytes
    sent. A file that cannot be read is sent as size -1 (the receiver raises) and the
    OSError is raised here too."""
    try:
        f = path.open("rb")
        size = os.fstat(f.fileno()).st_size
    except OSError:
        comm.send(torch.tensor([-1], dtype=torch.int64), dst, group=group)
        raise
    with f:
        comm.send(torch.tensor([size], dtype=torch.int64), dst, group=group)
        digest = hashlib.sha256()
        left = size
        while left > 0:
            block = f.read(min(CHUNK, left))
            if not block:  # shrank while being sent: the receiver's digest will differ
                block = bytes(min(CHUNK, left))
            digest.update(block)
            comm.send(torch.frombuffer(bytearray(block), dtype=torch.uint8), dst, group=group)
            left -= len(block)
    comm.send(torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8), dst, group=group)
    return size


def recv_file(path: Path, src: int, group: comm.Group, sha256: str | None = None) -> int:
    """Receive the file group rank `src` sends (`send_file`) into `path`, atomically; when
    `sha256` is given the bytes must have that digest. Returns the bytes received.

    Raises:
        DtrainError: the sender could not read it, or the bytes do not match a digest.
        OSError: `path` cannot be written (every message was taken all the same).
    """
    header = comm.recv(torch.empty(1, dtype=torch.int64), src, group=group)
    size = int(header.item())
    if size < 0:
        raise DtrainError(f"rank {src} could not read its copy of {path.name}")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    digest, failed = hashlib.sha256(), None
    try:
        out = tmp.open("wb")
    except OSError as exc:
        out, failed = None, exc
    try:
        left = size
        while left > 0:
            block = comm.recv(torch.empty(min(CHUNK, left), dtype=torch.uint8), src,
                              group=group).numpy().tobytes()
            digest.update(block)
            left -= len(block)
            if out is not None and failed is None:
                try:
                    out.write(block)
                except OSError as exc:
                    failed = exc
        sent = comm.recv(torch.empty(32, dtype=torch.uint8), src, group=group)
        if out is not None:
            out.close()
        if failed is not None:
            raise failed
        got = digest.hexdigest()
        if got != bytes(sent.tolist()).hex() or (sha256 is not None and got != sha256):
            raise DtrainError(f"the copy of {path.name} from rank {src} does not match its "
                              "checksum")
        atomic.fsync(tmp)
        os.replace(tmp, path)
        atomic.fsync(path.parent)
    finally:
        if out is not None and not out.closed:
            out.close()
        tmp.unlink(missing_ok=True)
    return size


def all_gather_json(value: _J, group: comm.Group) -> list[_J]:
    """Every rank's `value` (JSON), in group rank order: collective over `group`."""
    data = json.dumps(value).encode()
    sizes = comm.all_gather(torch.tensor([len(data)], dtype=torch.int64), group=group)
    longest = int(sizes.max().item())
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    every = comm.all_gather(mine.unsqueeze(0), group=group)
    return [json.loads(every[r, : int(sizes[r])].numpy().tobytes())
            for r in range(group.size)]
