"""Checkpoints without a shared filesystem: each host keeps its own folder, and copies.

    copies = HostCopies.open(copies=1, host=world.node_rank)   # every rank, at the start
    path = copies.save(folder, step, pieces, extra, meta, keep_last, rank_tensors)
    path = copies.resume(folder)        # every rank: the newest checkpoint the hosts hold

`checkpoint.copies = K`. Every host runs the same command and has its own disk at the
same path (`train.out_dir`); `folder` is the checkpoints folder there. A checkpoint is
the same universal checkpoint as on a shared folder (dtrain.checkpoint.universal): the
same file names and checksums, its index.json on every host. Host h's folder holds the
files of its own ranks and copies of the files of hosts h-1 .. h-K (hosts numbered by
node rank, modulo their count): rank r's files lie on hosts h(r), h(r)+1 .. h(r)+K, so any
K hosts' folders can go and the others still hold every file; any K+1 consecutive hosts'
folders hold them all, the folders of all hosts but K too.

The copies travel over the job's own transport: a gloo process group of every rank,
made at the start for this alone (`open`), so a background save's messages (sent from
its thread) never interleave with training's collectives. Files go in chunks with their
SHA-256 (dtrain.checkpoint.transfer), and are written atomically; nothing is pickled.

A save, every rank (in the background save's thread, or in training's for a blocking save):
1. each host's first rank sweeps what crashed saves left and makes the hidden folder;
2. each rank writes its two files there (as on a shared folder), then sends them to the
   first rank of each of the K next hosts, which writes them into its hidden folder;
3. every rank's description (rank-NNNNN.json) goes to every rank (all-gather), and each
   host's first rank writes index.json, renames the folder into place and lists it in
   its folder's index, dropping nothing yet;
4. once every host has listed it, each drops what `keep_last` leaves out.
Each step ends in an all-gather of the ranks' outcomes, so a failure anywhere fails the
save on every rank with the same line. A checkpoint is listed only once all its copies
are written (3 after 2), and the one before it is dropped only once every host lists the
new one (4 after 3): a crash at any moment leaves the previous checkpoint, or the new
one, listed and whole on every host that is left (three hosts' ranks SIGKILLed at random
moments of their saves, 50 times under `make soak`: tests/checkpoint/test_checkpoint_copies.py).

Resume (`resume`, collective): each host's first rank reports the checkpoints its folder
lists, which of their files it has, and whether its copy of each index matches the digest
its folder recorded. From the newest down, the hosts check their copies of a checkpoint's
files against that index's digests; the first checkpoint whose every file some host holds
good is taken. A newer one with a file on no host (a save cut short between two hosts'
listings) is passed over; one with a file whose every copy is damaged is moved aside on
every host (dtrain.checkpoint.fallback), and the first rank says so in one line. Then each
host is sent every file it lacks or holds damaged (the damaged copy moved into damaged/
first; a host whose folder was lost gets all of them): by the next host that holds it good,
and if that copy arrives wrong (its digest differs), by the one after, in turn. Every rank
then opens the checkpoint from its own folder, in any layout, as from a shared one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError

from dtrain import comm, env
from dtrain.checkpoint import atomic, fallback, transfer, universal
from dtrain.errors import ConfigError, DtrainError

HostListing = dict[str, dict[str, Any]]
"""A host's listed checkpoints by step (a string): {"name": its folder's name, "files":
the index's {file: sha256}, "has": the files present}."""


def check_copies(copies: int, hosts: int) -> None:
    """Refuse more copies than there are other hosts.

    Raises:
        ConfigError: `copies` > `hosts` - 1.
    """
    if copies > hosts - 1:
        raise ConfigError(f"checkpoint.copies = {copies} copies each host's checkpoint "
                          f"files to {copies} other host(s), and this job has {hosts} "
                          f"host(s): set it to at most {hosts - 1}")


class Copies(Protocol):
    """Checkpoint copies on other hosts, as training saves and resumes through them: a
    job's hosts (`HostCopies`), or live replicas' (dtrain.checkpoint.live_copies)."""

    def keep(self, folder: Path) -> None:
        """Keep this host's copies in `folder`, its checkpoints folder, from now on."""

    def save(self, folder: Path, step: int, pieces: list[universal.Piece],
             extra: dict[str, Any], meta: dict[str, Any], keep_last: int,
             rank_tensors: dict[str, torch.Tensor] | None = None) -> Path:
        """Save this rank's part of the checkpoint of `step`, copies included; its folder
        here."""

    def resume(self, where: str | Path) -> str | None:
        """The checkpoint to resume from in this host's folder, fetched where it lacks it."""


@dataclass
class HostCopies:
    """Checkpoint copies between the hosts of a job (module docstring).

    Attributes:
        group: the gloo group of every rank that carries the copies, and nothing else.
        hosts: each rank's host (0 .. hosts - 1, by node rank).
        copies: how many other hosts get a copy of each host's files.
    """

    group: comm.Group
    hosts: list[int]
    copies: int

    @classmethod
    def open(cls, copies: int, host: int) -> Copies:
        """The copies of a job whose rank runs on the host of node rank `host`: makes their
        gloo group (collective over the world: every rank calls it at the same point).
        Under live replicas (each a world of its own, written by whichever is first), the
        copies between their hosts instead (dtrain.checkpoint.live_copies).

        Raises:
            ConfigError: `copies` is more than the hosts minus one.
        """
        import torch.distributed as dist

        if copies and env.LIVE_ID.is_set():
            from dtrain.checkpoint.live_copies import LiveCopies

            return LiveCopies.open(copies)
        if not dist.is_initialized():  # one process: one host
            check_copies(copies, 1)
        group = transfer.side_group()
        nodes = comm.all_gather(torch.tensor([host], dtype=torch.int64), group=group).tolist()
        order = sorted(set(nodes))
        check_copies(copies, len(order))
        return cls(group, [order.index(n) for n in nodes], copies)

    def keep(self, folder: Path) -> None:
        """Nothing to do: every host's ranks write their own folder at each save."""

    @property
    def host(self) -> int:
        """This rank's host."""
        return self.hosts[self.group.rank]

    @property
    def count(self) -> int:
        """How many hosts the job has."""
        return max(self.hosts) + 1

    def leader(self, host: int) -> int:
        """The rank that writes and receives copies for `host`: its first."""
        return self.hosts.index(host)

    @property
    def leads(self) -> bool:
        """Whether this rank is its host's first."""
        return self.leader(self.host) == self.group.rank

    def holders(self, rank: int) -> list[int]:
        """The hosts whose folders hold `rank`'s files: its own, then the next `copies`."""
        return [(self.hosts[rank] + j) % self.count for j in range(self.copies + 1)]

    def save(self, folder: Path, step: int, pieces: list[universal.Piece],
             extra: dict[str, Any], meta: dict[str, Any], keep_last: int,
             rank_tensors: dict[str, torch.Tensor] | None = None) -> Path:
        """Save this rank's part of the checkpoint of `step` into `folder` on its host, with
        copies on the next hosts (the module docstring's steps): as `universal.save` does
        on a shared folder. Every rank calls it, in the same order.

        Returns:
            The checkpoint's folder on this host.

        Raises:
            DtrainError: it was not saved (the same line on every rank); the previous
                checkpoint is kept.
        """
        g, tmp = self.group, universal.unpublished(folder, step)

        def failed(exc: Exception) -> str:
            return str(universal.not_saved(folder, step, exc))

        try:
            self._agreed({"error": _attempt(lambda: universal.prepare(folder, step), failed)
                          if self.leads else ""})
            error = _attempt(lambda: universal.write_rank(tmp, g.rank, pieces, extra,
                                                          rank_tensors), failed)
            error = self._send_copies(tmp, error, failed)
            side: dict[str, Any] = {}
            if not error:
                try:
                    side = universal.description(tmp, g.rank)
                except OSError as exc:
                    error = failed(exc)
            every = self._agreed({"error": error, "side": side,
                                  "meta": meta if g.rank == 0 else {}})
            sides, path, error = [e["side"] for e in every], "", ""
            if self.leads:
                try:
                    path = universal.publish(folder, step, g.size, every[0]["meta"], None, sides,
                                             {"copies": self.copies,
                                              "hosts": self.hosts}).name
                except (OSError, SafetensorError, ValueError) as exc:
                    error = failed(exc)
            every = self._agreed({"error": error, "path": path})
        except DtrainError:
            if self.leads:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if self.leads:  # every host lists the new one: the old ones may go
            atomic.replace_index(folder, atomic.read_index(folder), keep_last)
        return folder / every[self.leader(self.host)]["path"]

    def _send_copies(self, tmp: Path, error: str, failed) -> str:
        """Step 2's copies: each rank's two files to the first rank of each of the next
        `copies` hosts, in one order on every rank; returns this rank's error (or
        `error`, or "")."""
        g = self.group
        for rank in range(g.size):
            for host in self.holders(rank)[1:]:
                to = self.leader(host)
                for name in (f"rank-{rank:05d}.safetensors", f"rank-{rank:05d}.json"):
                    if g.rank == rank:
                        error = _attempt(lambda n=name, t=to: transfer.send_file(tmp / n, t, g),
                                         failed) or error
                    elif g.rank == to:
                        error = _attempt(lambda n=name, r=rank: transfer.recv_file(tmp / n, r, g),
                                         failed) or error
        return error

    def _agreed(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's `mine` (all-gathered); the first "error" among them raised on every
        rank."""
        every = transfer.all_gather_json(mine, self.group)
        first = next((e["error"] for e in every if e.get("error")), "")
        if first:
            raise DtrainError(first)
        return every

    def resume(self, where: str | Path) -> str | None:
        """The checkpoint to resume from, on this host, with every file it lacks (or holds
        damaged) fetched from a host that holds a good copy: `where` is a checkpoints
        folder (the newest checkpoint the hosts hold whole and good between them; None when
        no host lists any) or one checkpoint in it (`step-NNNNNNNN`, that one or an error).
        Newer checkpoints are skipped where some file of theirs is on no host (a save cut
        short), and moved aside on every host where no copy of some file verifies
        (dtrain.checkpoint.fallback); the first rank says so in one line. Collective over
        every rank.

        Raises:
            DtrainError: no checkpoint the hosts hold verifies whole (each named, nothing
                moved), or no holder could send a good copy of a file.
        """
        folder, step = universal.folder_and_step(where)
        mine: HostListing = {}
        error = ""
        if self.leads:
            try:
                mine = _listing(folder)
            except DtrainError as exc:
                error = str(exc)
        listed = [e["listed"] for e in self._agreed({"error": error, "listed": mine})]
        listed = [listed[self.leader(h)] for h in range(self.count)]
        candidates = sorted({int(s) for h in listed for s in h}, reverse=True)
        if step is None and not candidates:
            return None
        seen: list[fallback.Skipped] = []
        for candidate in candidates if step is None else [step]:
            copies = _Copies.of(listed, candidate)
            good = self._verified(folder, copies)
            lacking = copies.lacking(good)
            if lacking is None:
                break
            seen.append(lacking)
        else:
            if step is not None:
                s = seen[0]
                raise DtrainError(f"checkpoint {s.name} in {folder}: {s.file} is {s.what} "
                                  "(checkpoint.copies keeps each file on that many hosts "
                                  "beyond its own)")
            raise fallback.none_verifies(folder, seen)
        # A file on no host at all is a save cut short between two hosts' listings (or
        # hosts lost): nothing there is damaged. Files that are there and wrong are.
        damaged = [s for s in seen if s.why != "missing"]
        said = self._move_damaged(folder, listed, damaged, copies.name)
        repaired = self._fetch_all(folder, copies, good)
        if self.group.rank == 0 and (said or repaired):
            print(f"dtrain: {'; '.join(filter(None, [said, repaired]))}", file=sys.stderr,
                  flush=True)
        return str(folder / copies.here(self.host))

    def _verified(self, folder: Path, copies: _Copies) -> list[list[str]]:
        """Which files of the checkpoint `copies` each host holds good copies of (its first
        rank checks their digests): collective."""
        error, good = "", []
        if self.leads and copies.lists(self.host):
            try:
                good = copies.good_here(folder, self.host)
            except OSError as exc:
                error = str(exc)
        every = self._agreed({"error": error, "good": good})
        return [every[self.leader(h)]["good"] for h in range(self.count)]

    def _move_damaged(self, folder: Path, listed: list[HostListing],
                      skipped: list[fallback.Skipped], taken: str) -> str:
        """Move each host's copies of the `skipped` checkpoints into its damaged/ (its first
        rank); the line that says so ("" when none was skipped). Collective."""
        if not skipped:
            return ""
        moved: dict[str, Path | None] = {}
        error = ""
        if self.leads:
            names = [listed[self.host][str(universal.step_of(s.name))]["name"] for s in skipped
                     if str(universal.step_of(s.name)) in listed[self.host]]
            try:
                moved = fallback.move_aside(folder, names)
            except OSError as exc:
                error = f"a damaged checkpoint could not be moved aside: {exc}"
        self._agreed({"error": error})
        shown = {s.name: moved.get(s.name, folder / fallback.DAMAGED / s.name)
                 for s in skipped}
        return fallback.describe(folder, skipped, shown, taken, " on each host that held it")

    def _fetch_all(self, folder: Path, copies: _Copies, good: list[list[str]]) -> str:
        """Give every host a good copy of every file of the checkpoint `copies`: each file a
        host lacks, or holds damaged (moved aside first), is sent by a host that holds a
        good one; a copy that arrives wrong is asked again of the next holder, in turn.
        Then the hosts that did not list it list it. Returns the line that names the
        damaged files replaced ("" when none was). Collective.

        Raises:
            DtrainError: every holder of some file failed to send a good copy.
        """
        target = folder / copies.here(self.host) if copies.lists(self.host) \
            else universal.unpublished(folder, copies.step)
        error = ""
        if self.leads:
            error = _attempt(lambda: copies.make_room(folder, self.host, good[self.host]), str)
        self._agreed({"error": error})
        pending = [(h, f) for h in range(self.count) for f in copies.files()
                   if f not in good[h]]
        tried: dict[tuple[int, str], list[str]] = {}  # what each holder asked answered
        attempt = 0
        while pending:
            failed: list[list[int | str]] = []
            for host, file in pending:
                holders = copies.holders(file, host, good)
                if attempt >= len(holders):
                    said = "; ".join(tried.get((host, file), [])) or "no host holds a good copy"
                    raise DtrainError(f"checkpoint {copies.name}: no host could send host "
                                      f"{host} a good copy of {file} ({said})")
                src = holders[attempt]
                why = self._fetch(folder / copies.here(src) / file, self.leader(src), host,
                                  target / file, copies.digest(file))
                if why:
                    failed.append([host, file, f"host {src}: {why}"])
            every = self._agreed({"error": "", "failed": failed})
            pending = []
            for host, file, why in (f for e in every for f in e["failed"]):
                pending.append((int(host), str(file)))
                tried.setdefault((int(host), str(file)), []).append(str(why))
            pending.sort()
            attempt += 1
        name = copies.name
        if self.leads and not copies.lists(self.host):
            error = _attempt(lambda: _list(folder, target, folder / name, copies.step,
                                           copies.digest(universal.INDEX)), str)
        self._agreed({"error": error})
        return copies.repaired(folder, good)

    def _fetch(self, source: Path, src: int, host: int, target: Path,
               sha256: str | None) -> str:
        """One file of a resume's: `source` sent by rank `src` to `host`'s first rank, which
        writes it as `target` if it matches `sha256`; on that rank, why it did not arrive
        good ("" when it did, and on every other rank). A sender's own error shows as the
        receiver's."""
        g, dst = self.group, self.leader(host)
        if g.rank == src:
            _attempt(lambda: transfer.send_file(source, dst, g), str)
        elif g.rank == dst:
            return _attempt(lambda: transfer.recv_file(target, src, g, sha256), str)
        return ""


@dataclass
class _Copies:
    """The hosts' copies of the checkpoint of one step, as their listings say.

    Attributes:
        step: its step.
        listed: every host's listing (a host may not list it).
        files_of: its files and their digests, from the index of the first host whose index
            verifies (None: none does).
        index: the digest of that index, as its checkpoints folder recorded it (None: none
            recorded, an older dtrain's checkpoint).
    """

    step: int
    listed: list[HostListing]
    files_of: dict[str, str] | None
    index: str | None

    @classmethod
    def of(cls, listed: list[HostListing], step: int) -> _Copies:
        key = str(step)
        held = [h[key] for h in listed if key in h and h[key]["files"] is not None]
        return cls(step, listed, held[0]["files"] if held else None,
                   held[0]["index"] if held else None)

    @property
    def name(self) -> str:
        return f"step-{self.step:08d}"

    def lists(self, host: int) -> bool:
        """Whether `host`'s folder lists the checkpoint."""
        return str(self.step) in self.listed[host]

    def here(self, host: int) -> str:
        """The checkpoint's folder name on `host` (its listed one, or the plain name)."""
        return self.listed[host].get(str(self.step), {}).get("name", self.name)

    def files(self) -> list[str]:
        """Its files, the index last (published with the folder)."""
        return [*sorted(self.files_of or {}), universal.INDEX]

    def digest(self, file: str) -> str | None:
        return self.index if file == universal.INDEX else (self.files_of or {}).get(file)

    def good_here(self, folder: Path, host: int) -> list[str]:
        """(On `host`.) Its files whose copy in `folder` matches its digest: the index when
        it is the one that verified."""
        mine = self.listed[host][str(self.step)]
        path = folder / mine["name"]
        good = [f for f, digest in (self.files_of or {}).items()
                if f in mine["has"] and atomic.sha256(path / f) == digest]
        same_index = mine["files"] is not None and mine["index"] == self.index
        return good + ([universal.INDEX] if same_index else [])

    def lacking(self, good: list[list[str]]) -> fallback.Skipped | None:
        """The first file no host holds a good copy of (None: the checkpoint is whole)."""
        if self.files_of is None:
            whys = [h[str(self.step)]["why"] for h in self.listed if str(self.step) in h]
            why = next((w for w in whys if w), "missing")
            return fallback.Skipped(self.name, universal.INDEX, f"{why} on every host", why)
        for file in self.files():
            if not any(file in g for g in good):
                present = any(file in h[str(self.step)]["has"] for h in self.listed
                              if str(self.step) in h)
                why = "checksum mismatch" if present else "missing"
                what = universal.MISMATCH if present else "missing"
                return fallback.Skipped(self.name, file, f"{what} on every host", why)
        return None

    def holders(self, file: str, host: int, good: list[list[str]]) -> list[int]:
        """The hosts holding a good copy of `file`, the next after `host` first."""
        count = len(self.listed)
        return [h for h in ((host + j) % count for j in range(1, count)) if file in good[h]]

    def make_room(self, folder: Path, host: int, good: list[str]) -> None:
        """(On `host`.) The folder its fetched files go into: a listed one, its damaged
        files moved into damaged/; or a fresh hidden one."""
        mine = self.listed[host].get(str(self.step))
        if mine is None:
            _make(universal.unpublished(folder, self.step))
            return
        for file in self.files():
            if file in mine["has"] and file not in good:
                fallback.aside(folder / mine["name"] / file, folder, f"{mine['name']}/{file}")

    def repaired(self, folder: Path, good: list[list[str]]) -> str:
        """The line naming each host's damaged files replaced by a good copy ("": none)."""
        said = []
        for host, listing in enumerate(self.listed):
            mine = listing.get(str(self.step))
            if mine is None:
                continue
            bad = [f for f in self.files() if f in mine["has"] and f not in good[host]]
            if bad:
                said.append(f"host {host}'s {', '.join(bad)}")
        if not said:
            return ""
        return (f"checkpoint {self.name}: {'; '.join(said)} did not verify: moved to "
                f"{folder.name}/{fallback.DAMAGED}/{self.name}/ there, good copies "
                "fetched from the hosts that hold them")


def _attempt(action, failed) -> str:
    """Run `action()`; "" when it worked, else `failed(the error)` (a local failure of one
    step of a save or resume, which the ranks then agree on)."""
    try:
        action()
    except (OSError, SafetensorError, DtrainError) as exc:
        return failed(exc)
    return ""


def _listing(folder: Path) -> HostListing:
    """What `folder` (a host's checkpoints folder) lists, and has of each checkpoint."""
    listing: HostListing = {}
    for entry in atomic.read_index(folder):
        if entry.get("format") != universal.FORMAT:
            continue
        path = folder / entry["file"]
        files, why = _index_files(path, entry.get("sha256"))
        has = [p.name for p in path.iterdir() if p.is_file()] if path.is_dir() else []
        listing[str(entry["step"])] = {"name": entry["file"], "files": files, "why": why,
                                       "index": entry.get("sha256"), "has": has}
    return listing


def _index_files(path: Path, digest: str | None) -> tuple[dict[str, str] | None, str]:
    """The files and digests the index.json of the checkpoint `path` lists, if it matches
    `digest` (the one its checkpoints folder recorded; None: not recorded); else None and
    why not."""
    try:
        raw = (path / universal.INDEX).read_bytes()
    except FileNotFoundError:
        return None, "missing"
    except OSError as exc:
        return None, f"unreadable ({exc.strerror})"
    if digest is not None and hashlib.sha256(raw).hexdigest() != digest:
        return None, "checksum mismatch"
    try:
        files = json.loads(raw)["files"]
    except (ValueError, KeyError, TypeError):
        return None, "unreadable"
    return (files, "") if isinstance(files, dict) else (None, "unreadable")


def _make(target: Path) -> None:
    """The folder a resume's fetched files go into: a listed one, or a fresh hidden one."""
    if target.name.startswith("."):
        shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True, exist_ok=True)


def _list(folder: Path, tmp: Path, final: Path, step: int, index: str | None) -> None:
    """Make the checkpoint fetched into `tmp` visible as `final` and list it, in step order,
    with its index's digest (`index`; computed when None)."""
    if final.exists():  # unlisted: left by a save that crashed before listing it
        shutil.rmtree(final)
    tmp.rename(final)
    atomic.fsync(folder)
    entries = [e for e in atomic.read_index(folder) if e["file"] != final.name]
    entries.append(universal.listing(final.name, step,
                                     index or atomic.sha256(final / universal.INDEX)))
    entries.sort(key=lambda e: e["step"])
    atomic.replace_index(folder, entries, len(entries))
