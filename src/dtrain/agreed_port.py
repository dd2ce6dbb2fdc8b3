"""A free port for rank 0's store, agreed by the ranks of one machine through a file.

mpirun and srun on one machine tell a process its rank but not where rank 0 listens.
Rather than guess a port (a hash of the job id can land on a port in use), rank 0 binds
127.0.0.1 port 0, so the kernel picks a free one, hands that socket to its TCPStore, and
publishes the port in a file every rank can name: `port-<key>` in a private folder
(`$TMPDIR/dtrain-<uid>`, mode 0700), where `key` names the job from the launcher's
environment (Open MPI's PMIx namespace, SLURM's job and step). The other ranks wait for
the file and connect; rank 0 removes it once every rank has joined.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from dtrain.errors import DtrainError

HOST = "127.0.0.1"
_POLL_S = 0.05


def folder() -> Path:
    """The private folder of this user's port files (created 0700 if missing).

    Raises:
        DtrainError: it exists but another user owns it or others may write into it.
    """
    path = Path(tempfile.gettempdir()) / f"dtrain-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise DtrainError(f"{path} is not private to this user (mode "
                          f"{info.st_mode & 0o777:o}): remove it and start the job again")
    return path


def port_file(key: str) -> Path:
    """The file where rank 0 publishes its port for the job named `key`."""
    return folder() / f"port-{re.sub(r'[^A-Za-z0-9_.-]', '_', key)}"


def local_store(key: str, rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """Rank 0's store on 127.0.0.1 at a free port, which every rank learns through a file.

    Rank 0 returns once all `world_size` ranks have connected; the others once they have.

    Args:
        key: names the job, the same in every rank and in no other job of this user.
        rank: this process's rank; rank 0 serves the store.
        world_size: the number of ranks that connect.
        timeout: how long to wait for the port file, and for the store.

    Raises:
        DtrainError: the port file did not appear within `timeout` (rank 0 is not running),
            or the folder is not private.
    """
    path = port_file(key)
    if rank != 0:
        port = _wait_for_port(path, rank, timeout)
        return dist.TCPStore(HOST, port, world_size, False, timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((HOST, 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    _publish(path, f"{port} {os.getpid()}\n")
    try:  # the store owns the socket from here; it waits for every rank to connect
        return dist.TCPStore(HOST, port, world_size, True, timeout, wait_for_workers=True,
                             master_listen_fd=sock.detach())
    except (RuntimeError, dist.DistError) as exc:
        raise DtrainError(f"rank 0 waited {timeout.total_seconds():g}s at {HOST}:{port} "
                          f"for the other {world_size - 1} ranks to join ("
                          f"{str(exc).splitlines()[0]})") from None
    finally:
        path.unlink(missing_ok=True)


def _publish(path: Path, text: str) -> None:
    """Write `path` atomically: a reader sees the whole text or no file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".port-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _wait_for_port(path: Path, rank: int, timeout: timedelta) -> int:
    """The port rank 0 published in `path`; a file left by a process that is gone (a job
    before this one with the same key) does not count."""
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        try:
            port, pid = (int(word) for word in path.read_text().split())
            os.kill(pid, 0)
            return port
        except (FileNotFoundError, ProcessLookupError, ValueError):
            time.sleep(_POLL_S)
    raise DtrainError(f"rank {rank} waited {timeout.total_seconds():g}s for rank 0 to "
                      f"publish its port in {path}: check that rank 0 runs on this machine")
