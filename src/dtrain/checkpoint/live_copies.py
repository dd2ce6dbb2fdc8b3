"""Checkpoint copies between the hosts of live replicas (`checkpoint.copies = K` with
`[fault_tolerance] mode = "live"`).

    copies = LiveCopies.open(copies=1)        # every rank of every live replica, at the start
    copies.keep(folder)                        # its host's checkpoints folder (a keeper starts)
    path = copies.resume(folder)               # the newest checkpoint some host holds good
    path = copies.save(folder, step, pieces, extra, meta, keep_last, rank_tensors)

Every live replica holds the whole training state, and the first of each step's quorum
writes the checkpoints (dtrain.ft.live.job). Without a shared filesystem a checkpoint then
lands on the disk of whichever host runs that replica, and goes with that host. With
copies, the writer (whichever replica it is now: the copies follow it when the first one
changes) sends each checkpoint it publishes to the keepers of K other disks, where it is
published whole: any one of those disks can resume it alone.

A live replica is a world of its own (no process group spans two replicas: a replacement
could never join one), so the copies go between the replicas' first ranks through the job's
store (dtrain.store) and a gloo group of two made on it for each transfer
(transfer.PairGroup). Each replica's first rank runs a *keeper*, a thread for its host's
checkpoints folder:

- it names the folder's disk: a random id kept in the folder (`.disk`, made once), so that
  replicas sharing a disk (on one host, or a shared filesystem) read the same id and are
  sent one copy between them; it posts the id and beats in the store;
- it takes the copies offered to it: the files arrive into the hidden `.step-N.tmp/`, each
  checked against its digest in the writer's index (and that index against the digest the
  writer's folder recorded for it), then the folder is published and listed as a save
  publishes it, with the writer's `keep_last`;
- it sends a checkpoint of its folder to a replica resuming on a disk that lacks it;
- when its process ends, it waits for the other keepers still beating to end as well: the
  writer's last save sends its copies after the other replicas have finished training.

The writer's replica saves as a one-host job does: its ranks into its own folder, over a
gloo group of the replica made at the start for this alone, so that a background save's
thread never mixes with training's collectives. Then its first rank offers the published
checkpoint to the keepers of the K next disks (the disks in the order of their ids from its
own on, each through its first beating keeper), sends the files and waits for each answer.
A keeper that does not answer (it died, or its disk is full) costs that copy and a warning,
not the save.

Resume: each replica's first rank checks every checkpoint its folder lists (as
dtrain.checkpoint.fallback does), posts what verifies, and waits up to START_TIMEOUT for the
other replicas' posts (replicas start together; one that never posts is left out). The
newest checkpoint some disk holds good is taken. On a disk that lacks it, or holds it
damaged, the first replica there asks a keeper that holds it good for a copy (the next one
if the copy does not verify), after moving the damaged newer ones aside (into damaged/,
with the line that says so). Every replica resumes the same step.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtrain import comm, env
from dtrain import world as world_mod
from dtrain.checkpoint import atomic, fallback, transfer, universal
from dtrain.errors import DtrainError
from dtrain.store import connect, prefixed
from dtrain.store.heartbeat import Heartbeat

DISK = ".disk"
"""The file in a checkpoints folder that names its disk (a random id, made once)."""
BEAT_PERIOD = 0.5
"""Seconds between a keeper's beats."""
SILENT = 5.0
"""Seconds without a beat after which a keeper is taken for gone: not sent copies, not
waited for."""
START_TIMEOUT = 60.0
"""How long a resume waits for the other live replicas to post what their folders hold."""
TRANSFER_TIMEOUT = timedelta(seconds=60)
"""How long one transfer waits for the other side, to join or to send its next message."""
LEAVE_TIMEOUT = 300.0
"""How long a keeper whose process ends waits for the others to end too."""
POLL = 0.05
"""Seconds between a keeper's looks at the store for offers and requests."""


def _store() -> dist.Store:
    """A client of the job's store under this run's copies' keys."""
    return prefixed(f"dtrain/live-copies/{env.RUN_ID.get() or ''}/", connect(60.0))


class LiveCopies:
    """Checkpoint copies between live replicas' hosts (module docstring).

    Attributes:
        copies: how many other disks get a copy of each checkpoint.
        replica, slots: this live replica's id, and how many the job runs.
        group: a gloo group of the replica's ranks, for its saves alone (None: a replica of
            one process with no process group).
    """

    def __init__(self, copies: int, replica: int, slots: int, group: comm.Group | None) -> None:
        self.copies, self.replica, self.slots, self.group = copies, replica, slots, group
        self.keeper: Keeper | None = None

    @classmethod
    def open(cls, copies: int) -> LiveCopies:
        """The copies of this live replica (DTRAIN_LIVE_ID, DTRAIN_LIVE_SLOTS): makes its
        replica's gloo group (collective over the replica's world)."""
        replica, slots = env.LIVE_ID.get(), env.LIVE_SLOTS.get()
        assert replica is not None and slots is not None  # set together by the supervisor
        group = transfer.side_group() if dist.is_initialized() else None
        return cls(copies, replica, slots, group)

    @property
    def first(self) -> bool:
        """Whether this rank is its replica's first (its keeper's, and writer's, rank)."""
        return self.group is None or self.group.rank == 0

    def keep(self, folder: Path) -> None:
        """Keep copies in `folder`, this host's checkpoints folder: the replica's first rank
        starts its keeper there."""
        if self.first and self.keeper is None:
            self.keeper = Keeper(folder, self.replica, self.slots)

    def save(self, folder: Path, step: int, pieces: list[universal.Piece],
             extra: dict[str, Any], meta: dict[str, Any], keep_last: int,
             rank_tensors: dict[str, torch.Tensor] | None = None) -> Path:
        """Save the replica's checkpoint of `step` into `folder` (every rank of the writer's
        replica calls it, as `universal.save`), then send it to the keepers of `copies`
        other disks (the first rank). Returns the checkpoint's folder here.

        Raises:
            DtrainError: it was not saved here (the copies' failures are warnings only).
        """
        path = universal.save(folder, step, pieces, extra, meta, keep_last, group=self.group,
                              rank_tensors=rank_tensors)
        if self.first and self.keeper is not None:
            said = self.keeper.spread(path, step, keep_last, self.copies)
            if said:
                print(f"dtrain: warning: {said}", file=sys.stderr, flush=True)
        return path

    def resume(self, where: str | Path) -> str | None:
        """The checkpoint to resume from in this host's folder (module docstring): `where` a
        checkpoints folder (the newest some disk holds good; None when none lists any) or
        one checkpoint in it. Collective over the replica's ranks.

        Raises:
            DtrainError: no disk holds a checkpoint that verifies (or the one named), or no
                holder could send a good copy.
        """
        folder, step = universal.folder_and_step(where)
        answer: dict[str, Any] = {"error": "", "path": None}
        if self.first:
            keeper = self.keeper or Keeper(folder, self.replica, self.slots)
            self.keeper = keeper
            try:
                name = keeper.resume(folder, step)
                answer["path"] = None if name is None else str(folder / name)
            except (DtrainError, OSError) as exc:
                answer["error"] = str(exc)
        if self.group is not None:
            answer = transfer.all_gather_json(answer, self.group)[0]
        if answer["error"]:
            raise DtrainError(answer["error"])
        return answer["path"]


class Keeper:
    """The thread that keeps a live replica's host's checkpoint copies (module docstring).

    Args:
        folder: the host's checkpoints folder.
        replica: the live replica whose first rank runs it.
        slots: how many live replicas the job runs.
    """

    def __init__(self, folder: Path, replica: int, slots: int) -> None:
        self.folder, self.replica, self.slots = folder, replica, slots
        self.disk = _disk_of(folder)
        self._store = _store()
        self._store.set(f"disk/{replica}", self.disk)
        self._beats = Heartbeat(_store, str(replica), BEAT_PERIOD, prefix="beat/",
                                members=[str(r) for r in range(slots)],
                                name="dtrain-copies-beat")
        self._stop = threading.Event()
        # what a former life of this replica was offered or asked is not this one's
        self._seen = {kind: int(self._store.add(f"{kind}s/{replica}", 0))
                      for kind in ("offer", "request")}
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="dtrain-copies-keeper")
        self._thread.start()
        world_mod.at_shutdown(self.leave)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        store = _store()
        while not self._stop.wait(POLL):
            for kind, serve in (("offer", self._take), ("request", self._give)):
                key = f"{kind}/{self.replica}/{self._seen[kind] + 1}"
                while store.check([key]):
                    self._seen[kind] += 1
                    serve(store, json.loads(store.get(key)))
                    key = f"{kind}/{self.replica}/{self._seen[kind] + 1}"

    def _take(self, store: dist.Store, offer: dict[str, Any]) -> None:
        """Receive the checkpoint a writer offers into the hidden folder, then publish it;
        answer the writer ("" or why not)."""
        step = offer["step"]
        tmp = universal.unpublished(self.folder, step)
        error = ""
        try:
            _receive(store, offer["pair"], tmp, offer["files"], offer["index"])
            universal.place(self.folder, step, offer["keep_last"], by_step=True)
        except (DtrainError, OSError, RuntimeError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            error = f"host of live replica {self.replica}: {exc}"
        store.set(f"answer/{offer['pair']}", error)

    def _give(self, store: dist.Store, request: dict[str, Any]) -> None:
        """Send the checkpoint a resuming replica asks for (its files, then its index); a
        file that cannot be read goes as an error the other side sees."""
        path = self.folder / request["name"]
        try:
            group = transfer.PairGroup(store, request["pair"], 0, TRANSFER_TIMEOUT)
        except RuntimeError:
            return  # the asker is gone
        try:
            for name in request["files"]:
                transfer.send_file(path / name, 1, group)
        except (DtrainError, OSError, RuntimeError):
            pass  # the asker sees it, and asks the next holder
        finally:
            group.close()

    # ------------------------------------------------------------------ the writer's side
    def spread(self, path: Path, step: int, keep_last: int, copies: int) -> str:
        """(The writer's first rank.) Send the checkpoint published at `path` to the
        keepers of `copies` other disks; what went wrong, in one line ("" when nothing)."""
        raw = (path / universal.INDEX).read_bytes()
        files = json.loads(raw)["files"]
        offer = {"step": step, "files": files, "index": hashlib.sha256(raw).hexdigest(),
                 "keep_last": keep_last}
        targets = self._targets(copies)
        store, failed = _store(), []
        for replica in targets:
            pair = uuid.uuid4().hex
            n = store.add(f"offers/{replica}", 1)
            store.set(f"offer/{replica}/{n}", json.dumps({**offer, "pair": pair}))
            try:
                group = transfer.PairGroup(store, pair, 0, TRANSFER_TIMEOUT)
                try:
                    for name in [*sorted(files), universal.INDEX]:
                        transfer.send_file(path / name, 1, group)
                finally:
                    group.close()
                error = _answer(store, f"answer/{pair}", partial(self._alive, replica))
            except (DtrainError, OSError, RuntimeError) as exc:
                error = f"live replica {replica}'s host: {exc}"
            if error:
                failed.append(error)
        made = len(targets) - len(failed)
        if made == copies:
            return ""
        why = f" ({'; '.join(failed)})" if failed else ""
        return (f"checkpoint {path.name} has {made} copies on other hosts, not "
                f"checkpoint.copies = {copies}{why}: {len(targets)} other disk(s) have a live "
                "replica that keeps copies")

    def _targets(self, copies: int) -> list[int]:
        """The replicas whose keepers get this writer's copies: on each other disk its
        first beating one, the disks in the order of their ids from this one's on."""
        store = self._store
        disks: dict[str, int] = {}
        for r in range(self.slots):
            key = f"disk/{r}"
            if r != self.replica and store.check([key]) and self._alive(r):
                disk = store.get(key).decode()
                if disk != self.disk:
                    disks.setdefault(disk, r)
        order = sorted(disks)
        after = [d for d in order if d > self.disk] + [d for d in order if d < self.disk]
        return [disks[d] for d in after[:copies]]

    def _alive(self, replica: int) -> bool:
        return self._beats.silent_for(str(replica)) < SILENT

    # ------------------------------------------------------------------ resume
    def resume(self, folder: Path, step: int | None) -> str | None:
        """(A replica's first rank.) The name of the checkpoint this replica resumes from in
        `folder` (the newest some disk holds good, or that of `step`), fetched where this
        disk lacks it; an older one where no holder could send it.

        Raises:
            DtrainError: no disk holds one that verifies (or that of `step`), or none could
                be fetched.
        """
        mine = _verified(folder)
        if step is not None and mine.get(str(step), {}).get("good"):
            return str(mine[str(step)]["name"])  # the one asked for, good here
        store = self._store
        store.set(f"listing/{self.replica}", json.dumps({"disk": self.disk, "steps": mine}))
        listings = self._listings()
        candidates = sorted({int(s) for seen in listings.values() for s in seen["steps"]},
                            reverse=True) if step is None else [step]
        skipped, failed = [], []
        for candidate in candidates:
            holders = [r for r, seen in listings.items()
                       if seen["steps"].get(str(candidate), {}).get("good")]
            if not holders:
                skipped.append(_skipped(listings, candidate))
                continue
            key = f"resumed/{self.disk}/{candidate}"
            first = min(r for r, seen in listings.items() if seen["disk"] == self.disk
                        and (r == self.replica or self._alive(r)))
            if first != self.replica:  # another replica on this disk fetches for both
                return _answer_name(store, key, partial(self._alive, first))
            try:
                name = self._bring(folder, candidate, mine, listings, holders)
            except (DtrainError, OSError) as exc:
                failed.append(str(exc))
                store.set(key, json.dumps({"error": str(exc)}))
                continue
            store.set(key, json.dumps({"name": name}))
            return name
        if failed:
            raise DtrainError("; ".join(failed))
        if not skipped:
            return None
        if step is not None:
            s = skipped[0]
            raise DtrainError(f"checkpoint {s.name} in {folder}: {s.file} is {s.what} on every "
                              "host that holds it")
        raise fallback.none_verifies(folder, skipped)

    def _listings(self) -> dict[int, dict[str, Any]]:
        """Every live replica's post of what its folder holds, waited for up to
        START_TIMEOUT (a replica that never posts is left out)."""
        store, deadline = self._store, time.monotonic() + START_TIMEOUT
        keys = [f"listing/{r}" for r in range(self.slots)]
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(POLL)
        return {r: json.loads(store.get(key)) for r, key in enumerate(keys)
                if store.check([key])}

    def _bring(self, folder: Path, step: int, mine: dict[str, dict[str, Any]],
               listings: dict[int, dict[str, Any]], holders: list[int]) -> str:
        """Make this disk hold the checkpoint of `step` good: move the damaged ones from
        it on aside (saying so), and fetch it from `holders` in turn where it lacks it."""
        damaged = [s for s in sorted(mine, key=int, reverse=True)
                   if int(s) >= step and not mine[s]["good"]]
        if damaged:
            moved = fallback.move_aside(folder, [mine[s]["name"] for s in damaged])
            skipped = [fallback.Skipped(mine[s]["name"], mine[s]["file"], mine[s]["what"],
                                        mine[s]["why"]) for s in damaged]
            print(f"dtrain: {fallback.describe(folder, skipped, moved, f'step-{step:08d}')}",
                  file=sys.stderr, flush=True)
        here = mine.get(str(step))
        if here is not None and here["good"]:
            return str(here["name"])
        tried = []
        for holder in holders:
            error = self._fetch(folder, step, holder, listings[holder]["steps"][str(step)])
            if not error:
                return universal.place(folder, step, None, by_step=True).name
            tried.append(f"live replica {holder}'s host: {error}")
        raise DtrainError(f"checkpoint step-{step:08d}: no host could send a good copy of it "
                          f"({'; '.join(tried)})")

    def _fetch(self, folder: Path, step: int, holder: int, theirs: dict[str, Any]) -> str:
        """Ask `holder`'s keeper for the checkpoint of `step` it holds (`theirs`: as it
        posted it) into the hidden folder here; "" when it arrived good, else why not."""
        store, pair = self._store, uuid.uuid4().hex
        tmp = universal.unpublished(folder, step)
        files = [*sorted(theirs["files"]), universal.INDEX]
        n = store.add(f"requests/{holder}", 1)
        store.set(f"request/{holder}/{n}",
                  json.dumps({"name": theirs["name"], "files": files, "pair": pair}))
        try:
            _receive(store, pair, tmp, theirs["files"], theirs["index"])
        except (DtrainError, OSError, RuntimeError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            return str(exc)
        return ""

    # ------------------------------------------------------------------ the end
    def leave(self) -> None:
        """(At the process's end.) Say this keeper is done; wait up to LEAVE_TIMEOUT for
        every other one still beating to say so too; then stop."""
        if self._stop.is_set():
            return
        store = self._store
        store.set(f"done/{self.replica}", "1")
        deadline = time.monotonic() + LEAVE_TIMEOUT
        others = [r for r in range(self.slots) if r != self.replica]
        while time.monotonic() < deadline and any(
                self._alive(r) and not store.check([f"done/{r}"]) for r in others):
            time.sleep(POLL)
        self._stop.set()
        self._thread.join()
        self._beats.stop()


def _disk_of(folder: Path) -> str:
    """The id of `folder`'s disk: read from its `.disk`, or made there (once: the first
    process to create the file wins, the others read it)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / DISK
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        deadline = time.monotonic() + 10
        while not (text := path.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(POLL)  # its maker is writing it
        return text
    with os.fdopen(fd, "w") as f:
        f.write(uuid.uuid4().hex)
        f.flush()
        os.fsync(f.fileno())
    return path.read_text().strip()


def _receive(store: dist.Store, pair: str, tmp: Path, files: dict[str, str],
             index: str | None) -> None:
    """Receive a checkpoint's `files`, then its index, over the pair group `pair` (rank 1)
    into `tmp`, each checked against its digest (the index's: `index`, when recorded).

    Raises:
        DtrainError, OSError, RuntimeError: a file did not arrive good.
    """
    shutil.rmtree(tmp, ignore_errors=True)  # what a transfer cut short left (not swept:
    tmp.mkdir(parents=True)  # a save of this process may be writing its own hidden folder)
    group = transfer.PairGroup(store, pair, 1, TRANSFER_TIMEOUT)
    try:
        for name in sorted(files):
            transfer.recv_file(tmp / name, 0, group, files[name])
        transfer.recv_file(tmp / universal.INDEX, 0, group, index)
    finally:
        group.close()
    atomic.fsync(tmp)


def _answer(store: dist.Store, key: str, alive: Callable[[], bool]) -> str:
    """The answer posted under `key`, waited for while the one who answers beats (its
    error, or "")."""
    while not store.check([key]):
        if not alive():
            return "it stopped beating before it answered"
        time.sleep(POLL)
    return store.get(key).decode()


def _answer_name(store: dist.Store, key: str, alive: Callable[[], bool]) -> str:
    """The checkpoint another replica on this disk fetched for both (posted under `key`).

    Raises:
        DtrainError: it failed, or stopped beating first.
    """
    said = _answer(store, key, alive)
    if not said.startswith("{"):
        raise DtrainError(f"the live replica fetching the checkpoint for this host: {said}")
    answer = json.loads(said)
    if "error" in answer:
        raise DtrainError(answer["error"])
    return str(answer["name"])


def _verified(folder: Path) -> dict[str, dict[str, Any]]:
    """What `folder` lists, by step: each checkpoint's name, whether it verifies (every
    file checked), and if not the first file wrong and why; its files' digests and its
    index's, for a replica that asks for it."""
    held: dict[str, dict[str, Any]] = {}
    for entry in atomic.read_index(folder):
        if entry.get("format") != universal.FORMAT:
            continue
        path = folder / entry["file"]
        mine: dict[str, Any] = {"name": entry["file"], "good": False, "file": "its folder",
                                "what": "missing", "why": "missing"}
        if path.is_dir():
            try:
                ckpt = universal.Checkpoint(path)
                mine.update(good=True, files=ckpt.index["files"],
                            index=entry.get("sha256"))
            except universal.Damaged as exc:
                mine.update(file=exc.file.name, what=exc.what, why=exc.why)
        held[str(entry["step"])] = mine
    return held


def _skipped(listings: dict[int, dict[str, Any]], step: int) -> fallback.Skipped:
    """Why no disk holds the checkpoint of `step` good: as the first that lists it says."""
    said = next((seen["steps"][str(step)] for seen in listings.values()
                 if str(step) in seen["steps"]), None)
    name = f"step-{step:08d}"
    if said is None:
        return fallback.Skipped(name, "its folder", "missing", "missing")
    return fallback.Skipped(name, said["file"], said["what"], said["why"])
