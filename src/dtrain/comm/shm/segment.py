"""Shared-memory segments: named per job, created by one rank, gone from /dev/shm at once.

The group's first rank creates `/dev/shm/dtrain-<job>-<group>-<random>` with its full size
reserved (so a full /dev/shm fails here, with a clear message, and not later with SIGBUS),
publishes the name through the job's store, and every member maps it. As soon as all have
mapped it, the creator unlinks the name: the memory lives on while mapped and is freed by
the kernel when the last member exits, however it exits (crash, SIGKILL). The only window
for a leak is set-up itself; the launcher closes it by removing `dtrain-<job>-*` when the
job ends (`sweep`).
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
from pathlib import Path

from dtrain import env
from dtrain.errors import DtrainError

SHM_DIR = Path("/dev/shm")
PREFIX = "dtrain-"


def sanitize(text: str) -> str:
    """`text` with anything but letters, digits, '_' and '.' replaced: safe in a file name."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", text)


def job_id() -> str:
    """The job's name for its segments: dtrain's run id, the elastic agent's, or this pid."""
    raw = (env.RUN_ID.get() or os.environ.get("TORCHELASTIC_RUN_ID")
           or f"pid{os.getpid()}")
    return sanitize(raw)


def new_name(group: str) -> str:
    return f"{PREFIX}{job_id()}-{sanitize(group)}-{secrets.token_hex(4)}"


def create(name: str, nbytes: int) -> mmap.mmap:
    """Create segment `name` of `nbytes`, all of it reserved, and map it."""
    path = _path(name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            os.unlink(path)
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                free = os.statvfs(path.parent)
                raise DtrainError(
                    f"the shm backend needs {nbytes / 2**20:.0f} MiB in {path.parent} but "
                    f"{free.f_bavail * free.f_frsize / 2**20:.0f} MiB are free: enlarge it "
                    "(docker run --shm-size), lower DTRAIN_SHM_SLOT_MB, or use backend gloo"
                ) from None
            raise
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def attach(name: str, nbytes: int) -> mmap.mmap:
    """Map the existing segment `name`."""
    fd = os.open(_path(name), os.O_RDWR)
    try:
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def unlink(name: str) -> None:
    """Remove the name (the memory stays while mapped); no error if it is gone already."""
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass


def sweep(job: str) -> list[str]:
    """Remove every segment of `job` still named in /dev/shm; returns what was removed."""
    removed = []
    for path in SHM_DIR.glob(f"{PREFIX}{job}-*") if SHM_DIR.is_dir() else ():
        try:
            path.unlink()
            removed.append(path.name)
        except OSError:
            pass
    return removed


def _path(name: str) -> Path:
    if not SHM_DIR.is_dir():
        raise DtrainError(f"the shm backend needs {SHM_DIR} (Linux): use backend gloo here")
    return SHM_DIR / name
