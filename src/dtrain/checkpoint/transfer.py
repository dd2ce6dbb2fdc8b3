"""Files and JSON between ranks over a process group: checkpoint copies from host to host.

    send_file(path, dst, group)                 # on the rank that has the file
    recv_file(path, src, group, sha256)         # on the rank that wants it: written atomically
    every = all_gather_json(value, group)       # each rank's JSON value, in rank order
    group = PairGroup(store, key, rank)         # two processes of no common group (0 and 1)

A file goes as its size (one int64), then its bytes in messages of at most CHUNK bytes
(one file never sits whole in memory), then its SHA-256 as computed while it was read.
The receiver hashes what it writes to a hidden temporary file and renames it into place
only when both digests, and the one the checkpoint's index lists, agree; otherwise the
temporary goes and the call raises. Bytes are raw uint8 tensors and JSON: nothing
received is ever unpickled. A receiver that cannot write still takes every message, so
the two ranks stay in step and the next transfer is not mixed up with this one.

The messages are dtrain.comm's `send`/`recv`, with the group's timeout: a peer that never
sends fails the wait with its rank named. Two processes that share no process group (the
first ranks of two live replicas, each replica a world of its own) meet in a `PairGroup`,
a gloo group of two made on the job's store for one transfer.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

import torch
import torch.distributed as dist

from dtrain import comm
from dtrain.checkpoint import atomic
from dtrain.errors import DtrainError
from dtrain.store import prefixed

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


def side_group() -> comm.Group:
    """A gloo group of every rank of this world, for transfers alone (collective: every rank
    makes it at the same point): a thread's files and JSON never mix with training's
    collectives, whatever its backend."""
    from dtrain.comm.group import timeout_of

    pg = dist.new_group(backend="gloo", timeout=timeout_of(dist.group.WORLD))
    return comm.wrap(pg, "gloo")


def all_gather_json(value: _J, group: comm.Group,
                    device: torch.device | None = None) -> list[_J]:
    """Every rank's `value` (JSON), in group rank order: collective over `group`, whose
    tensors live on `device` (a GPU for NCCL's; default the CPU, gloo's)."""
    data = json.dumps(value).encode()
    sizes = comm.all_gather(torch.tensor([len(data)], dtype=torch.int64, device=device),
                            group=group).cpu()
    longest = int(sizes.max().item())
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    every = comm.all_gather(mine.unsqueeze(0).to(device), group=group).cpu()
    return [json.loads(every[r, : int(sizes[r])].numpy().tobytes())
            for r in range(group.size)]


class PairGroup(comm.Group):
    """Two processes joined for one transfer (ranks 0 and 1), where no process group holds
    both: a gloo process group made directly on the job's store under `key` (as a live
    quorum's is, dtrain.ft.live.group), driven through its own methods since
    torch.distributed does not know it. Each side makes it with the same `key`; making it
    waits (up to `timeout`) for the other, and so does every message.

    Raises:
        RuntimeError: the other side did not come within `timeout` (gloo's error).
    """

    backend = "gloo"

    def __init__(self, store: dist.Store, key: str, rank: int,
                 timeout: timedelta = timedelta(seconds=60)) -> None:
        self._store = prefixed(f"pair/{key}/", store)
        self.pg: dist.ProcessGroupGloo | None = dist.ProcessGroupGloo(self._store, rank, 2,
                                                                      timeout)
        self.rank, self.size, self.name, self.timeout = rank, 2, f"pair-{key}", timeout
        super().__init__(self.name)

    def _pg(self) -> dist.ProcessGroupGloo:
        if self.pg is None:
            raise DtrainError(f"{self.name} is closed")
        return self.pg

    def global_rank(self, group_rank: int) -> int:
        return group_rank

    # (a gloo backend's own send and recv, which torch's stubs leave out)
    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> dist.Work:
        return self._pg().send([tensor], peer, tag)  # type: ignore[attr-defined]

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> dist.Work:
        return self._pg().recv([tensor], peer, tag)  # type: ignore[attr-defined]

    def native(self, op: str, *args: Any, **kwargs: Any) -> dist.Work:
        raise DtrainError(f"{self.name} carries files (send and recv), not {op}")

    def store_set(self, key: str, value: str) -> None:
        self._store.set(f"kv/{key}", value)

    def store_get(self, key: str) -> str | None:
        key = f"kv/{key}"
        return self._store.get(key).decode() if self._store.check([key]) else None

    def close(self) -> None:
        """Let the gloo group go (its threads end with it)."""
        super().close()
        self.pg = None
