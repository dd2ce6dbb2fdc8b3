"""Checkpoints written by a background thread while training goes on.

    pending = background.save(folder, step, pieces, extra, meta, keep_last)
    ...                                   # the next steps run meanwhile
    path = pending.wait()                 # published; or the save's error is raised here

`save` copies what it is given before it returns: every piece's values and the rank's
tensors into new CPU memory (from a GPU too), `extra` and `meta` as JSON. The next
optimizer step cannot change what is written. A thread then writes the copy exactly as
`universal.save` does: every rank into the hidden `.step-N.tmp/`, then the first rank
publishes it atomically with its checksums and keeps the newest `keep_last`. A kill at any
moment leaves the previous checkpoint the newest listed one, and the half-written folder
unlisted (the next save sweeps it).

The ranks coordinate through the job's key-value store, not through collectives. The
training thread keeps issuing collectives on its process groups, and collectives issued on
one group from two threads interleave and deadlock. A second process group would work too,
but every rank would have to create it at the same point of the program, and it would be
one more set of connections (a gloo one beside NCCL). The store is already there, for
process and thread groups alike, and its messages are a few bytes. Through it, for each save,
the first rank posts that the hidden folder is ready, each rank posts that its files are
written (or the line that says why not), and the first rank posts the outcome: the name
it published, or why it did not. Every rank's `wait()` returns that folder or raises that
one line, the same line a blocking save gives. A rank that never posts (it died) fails
the save after the group's timeout.

At most one background save per group is in flight. A new one first waits for the
previous one (`finish`) and raises that save's error. Blocking saves through
dtrain.checkpoint.training do the same. The thread is not a daemon, and
`dtrain.shutdown()` waits for it, so a process that ends normally publishes its last
checkpoint before the process group goes. It runs at a lower CPU priority than training
(WRITER_NICENESS), and holds one more copy of the rank's state in memory while it writes.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from safetensors import SafetensorError

from dtrain import world as world_mod
from dtrain.checkpoint import universal
from dtrain.checkpoint.copies import Copies
from dtrain.errors import DtrainError

if TYPE_CHECKING:  # comm is imported where it is used, as universal.save does
    from dtrain.comm import Group, GroupLike

WRITER_NICENESS = 10
"""How much lower the writer thread's CPU priority is than training's (Linux): where the
cores are all busy training, as on a CPU-only host, the writer takes what they leave."""

_lock = threading.Lock()
_in_flight: dict[tuple[str, int] | None, PendingSave] = {}  # group (name, rank) -> newest
_started: dict[tuple[str, int], int] = {}  # group (name, rank) -> saves begun (store keys)


class PendingSave:
    """A checkpoint that a background thread is writing (or has written).

    Attributes:
        folder: the checkpoints folder.
        step: the step saved.
    """

    def __init__(self, folder: Path, step: int, write: Callable[[], Path] | None = None,
                 path: Path | None = None) -> None:
        self.folder, self.step = folder, step
        self._path, self._seen = path, False
        self._error: Exception | None = None
        self._thread = None
        if write is not None:
            self._thread = threading.Thread(target=self._run, args=(write,), daemon=False,
                                            name=f"dtrain-save-{step}")
            self._thread.start()

    def _run(self, write: Callable[[], Path]) -> None:
        if sys.platform == "linux":  # where a thread has a priority of its own
            me = threading.get_native_id()
            try:
                os.setpriority(os.PRIO_PROCESS, me,
                               min(19, os.getpriority(os.PRIO_PROCESS, me) + WRITER_NICENESS))
            except OSError:  # a sandbox may forbid it: the writer keeps training's priority
                pass
        try:
            self._path = write()
        except Exception as exc:  # raised again by wait(), in the caller's thread
            self._error = exc

    def done(self) -> bool:
        """True once the save is published or has failed (`wait()` then returns at once)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path:
        """Block until the checkpoint is published; returns its folder (as `universal.save`
        does).

        Raises:
            DtrainError: it was not saved (the one line a blocking save would give).
        """
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            self._seen = True
            raise self._error
        assert self._path is not None  # given, or set by the writer when it did not fail
        return self._path


def save(folder: str | Path, step: int, pieces: list[universal.Piece],
         extra: dict[str, Any], meta: dict[str, Any], keep_last: int,
         group: GroupLike | Literal["world"] = "world",
         rank_tensors: dict[str, torch.Tensor] | None = None,
         copies: Copies | None = None) -> PendingSave:
    """Copy this rank's `pieces` (and `extra`, `meta`, `rank_tensors`) to memory, then
    write them in the background as `universal.save(...)` with the same arguments would;
    returns the save, which `wait()`s for it. Called by every rank of `group` in the same
    order, from the thread that trains (a thread group is that thread's). With `copies`
    (hosts without a shared folder) the thread writes it as `copies.save` does, over the
    copies' own process group.

    Raises:
        DtrainError: the previous background save of `group` failed.
    """
    folder = Path(folder)
    g = _group(group)
    finish(group)
    pieces = [replace(p, values=_copy(p.values)) for p in pieces]
    tensors = {k: _copy(v) for k, v in (rank_tensors or {}).items()}
    extra, meta = json.loads(json.dumps(extra)), json.loads(json.dumps(meta))
    if copies is not None:
        write = partial(copies.save, folder, step, pieces, extra, meta, keep_last, tensors)
    elif g is None or g.size == 1:
        write = partial(universal.save, folder, step, pieces, extra, meta, keep_last, None,
                        tensors)
    else:
        with _lock:
            n = _started.get((g.name, g.rank), 0)
            _started[(g.name, g.rank)] = n + 1
        key = f"checkpoint/{g.name}/{n}/{step}"  # never reused by this process
        write = partial(_write_together, g, key, folder, step, pieces, extra, meta, keep_last,
                        tensors)
    pending = PendingSave(folder, step, write)
    with _lock:
        _in_flight[_key(g)] = pending
    world_mod.at_shutdown(_finish_all)
    return pending


def finish(group: GroupLike | Literal["world"] = "world") -> None:
    """Wait for the background save in flight on `group` (as given to `save`), if any.

    Raises:
        DtrainError: that save failed (and nobody has seen its error yet from `wait()`).
    """
    with _lock:
        pending = _in_flight.pop(_key(_group(group)), None)
    if pending is not None and not pending._seen:
        pending.wait()


def _finish_all() -> None:
    """At shutdown: let every save in flight end; an error nobody waited for is printed."""
    with _lock:
        pending = list(_in_flight.values())
        _in_flight.clear()
    for p in pending:
        seen = p._seen
        try:
            p.wait()
        except Exception as exc:
            if not seen:
                print(f"dtrain: {exc}", file=sys.stderr, flush=True)


def _group(group: GroupLike | Literal["world"]) -> Group | None:
    from dtrain import comm

    return None if group is None else comm.resolve(None if group == "world" else group)


def _key(g: Group | None) -> tuple[str, int] | None:
    return None if g is None else (g.name, g.rank)


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in new CPU memory (the original may change after the call)."""
    return t.detach().to("cpu", copy=True)


def _write_together(g: Group, key: str, folder: Path, step: int, pieces: list[universal.Piece],
                    extra: dict[str, Any], meta: dict[str, Any], keep_last: int,
                    tensors: dict[str, torch.Tensor]) -> Path:
    """One rank's part of a save over `g`, in step through the store under `key`."""
    tmp, timeout = universal.unpublished(folder, step), g.timeout.total_seconds()
    if g.rank == 0:
        try:
            universal.prepare(folder, step)
        except DtrainError as exc:
            _post(g, f"{key}/ready", {"error": str(exc)})
            raise
        _post(g, f"{key}/ready", {})
    else:
        _check(_await(g, f"{key}/ready", timeout, "rank 0 did not make the folder", folder,
                      step))
    try:
        universal.write_rank(tmp, g.rank, pieces, extra, tensors)
        written: dict[str, str] = {}
    except (OSError, SafetensorError) as exc:
        written = {"error": str(universal.not_saved(folder, step, exc))}
    if g.rank != 0:
        _post(g, f"{key}/written/{g.rank}", written)
        outcome = _check(_await(g, f"{key}/outcome", 2 * timeout,
                                "rank 0 did not publish it", folder, step))
        return folder / outcome["path"]
    try:
        errors = [written, *(_await(g, f"{key}/written/{r}", timeout,
                                    f"rank {r} did not write its pieces", folder, step)
                             for r in range(1, g.size))]
        _check(next((e for e in errors if "error" in e), {}))
        try:
            path = universal.publish(folder, step, g.size, meta, keep_last)
        except (OSError, SafetensorError) as exc:
            raise universal.not_saved(folder, step, exc) from None
    except DtrainError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        _post(g, f"{key}/outcome", {"error": str(exc)})
        raise
    _post(g, f"{key}/outcome", {"path": path.name})
    return path


def _post(g: Group, key: str, value: dict[str, str]) -> None:
    g.store_set(key, json.dumps(value))


def _await(g: Group, key: str, timeout: float, what: str, folder: Path,
           step: int) -> dict[str, str]:
    """The value posted under `key`, polled (a blocking store wait would hold the store's
    client, which the training thread shares); after `timeout` seconds, an error that says
    `what` did not happen."""
    deadline, pause = time.monotonic() + timeout, 0.001
    while (value := g.store_get(key)) is None:
        if time.monotonic() > deadline:
            return {"error": str(universal.not_saved(
                folder, step, TimeoutError(f"{what} within {timeout:.0f} s")))}
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    return json.loads(value)


def _check(posted: dict[str, str]) -> dict[str, str]:
    """`posted`, unless it is an error: then that error, raised."""
    if "error" in posted:
        raise DtrainError(posted["error"])
    return posted
