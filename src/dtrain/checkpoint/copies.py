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
one, listed and whole on every host that is left.

Resume (`resume`, collective): each host's first rank reports the checkpoints its folder
lists and which of their files it has; the newest step whose files the hosts hold
between them is chosen, and each host is sent the files it lacks (a host whose folder was
lost gets all of them), verified by the index's checksums; every rank then opens the
checkpoint from its own folder, in any layout, as from a shared one.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from dtrain import comm
from dtrain.checkpoint import atomic, transfer, universal
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


def step_of(name: str) -> int:
    """The step of a checkpoint folder's name (`step-00000200`, or `step-00000200.1`)."""
    return int(name.removeprefix("step-").split(".")[0])


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
    def open(cls, copies: int, host: int) -> HostCopies:
        """The copies of a job whose rank runs on the host of node rank `host`: makes their
        gloo group (collective over the world: every rank calls it at the same point).

        Raises:
            ConfigError: `copies` is more than the hosts minus one.
        """
        import torch.distributed as dist

        from dtrain.comm.group import timeout_of

        if not dist.is_initialized():  # one process: one host
            check_copies(copies, 1)
        pg = dist.new_group(backend="gloo", timeout=timeout_of(dist.group.WORLD))
        group = comm.wrap(pg, "gloo")
        nodes = comm.all_gather(torch.tensor([host], dtype=torch.int64), group=group).tolist()
        order = sorted(set(nodes))
        check_copies(copies, len(order))
        return cls(group, [order.index(n) for n in nodes], copies)

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
        """The checkpoint to resume from, on this host, with every file it lacks fetched
        from a host that has it: `where` is a checkpoints folder (the newest checkpoint the
        hosts hold between them; None when no host lists any) or one checkpoint in it
        (`step-NNNNNNNN`). Collective over every rank.

        Raises:
            DtrainError: no host left holds some file of the checkpoint, or a copy failed.
        """
        where = Path(where)
        step = step_of(where.name) if where.name.startswith("step-") else None
        folder = where.parent if step is not None else where
        mine: HostListing = {}
        error = ""
        if self.leads:
            try:
                mine = _listing(folder)
            except DtrainError as exc:
                error = str(exc)
        listed = [e["listed"] for e in self._agreed({"error": error, "listed": mine})]
        listed = [listed[self.leader(h)] for h in range(self.count)]
        chosen = _newest_whole(listed, step, folder)
        if chosen is None:
            return None
        key = str(chosen)
        files = next(h[key]["files"] for h in listed if key in h and h[key]["files"] is not None)
        name = f"step-{chosen:08d}"
        target = folder / listed[self.host][key]["name"] if key in listed[self.host] \
            else universal.unpublished(folder, chosen)
        error = ""
        if self.leads:
            error = _attempt(lambda: _make(target), str)
        self._agreed({"error": error})
        for host in range(self.count):
            have = set(listed[host][key]["has"]) if key in listed[host] else set()
            for file in [*sorted(files), universal.INDEX]:
                if file in have:
                    continue
                src = min(h for h in range(self.count)
                          if key in listed[h] and file in listed[h][key]["has"])
                error = self._fetch(folder / listed[src][key]["name"] / file, self.leader(src),
                                    host, target / file, files.get(file)) or error
        self._agreed({"error": error})
        if self.leads and key not in listed[self.host]:
            error = _attempt(lambda: _list(folder, target, folder / name, chosen), str)
        self._agreed({"error": error})
        return str(folder / listed[self.host][key]["name"] if key in listed[self.host]
                   else folder / name)

    def _fetch(self, source: Path, src: int, host: int, target: Path,
               sha256: str | None) -> str:
        """One file of a resume's: `source` sent by rank `src` to `host`'s first rank, which
        writes it as `target`; this rank's error, or ""."""
        g, dst = self.group, self.leader(host)
        if g.rank == src:
            return _attempt(lambda: transfer.send_file(source, dst, g), str)
        if g.rank == dst:
            return _attempt(lambda: transfer.recv_file(target, src, g, sha256), str)
        return ""


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
        try:
            files = json.loads((path / universal.INDEX).read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            files = None
        has = [p.name for p in path.iterdir() if p.is_file()] if path.is_dir() else []
        listing[str(entry["step"])] = {"name": entry["file"], "files": files, "has": has}
    return listing


def _newest_whole(listings: list[HostListing], step: int | None, folder: Path) -> int | None:
    """The newest step (or `step`) whose files, and an index, the hosts hold between them.

    Raises:
        DtrainError: `step` is not whole, or some host lists checkpoints and none is whole.
    """
    steps = sorted({int(s) for h in listings for s in h}, reverse=True)
    if step is None and not steps:
        return None
    missing = ""
    for candidate in steps if step is None else [step]:
        key = str(candidate)
        indexes = [h[key]["files"] for h in listings if key in h and h[key]["files"] is not None]
        if not indexes:
            missing = missing or f"{universal.INDEX} of step {candidate}"
            continue
        has = {f for h in listings if key in h for f in h[key]["has"]}
        lacking = sorted(set(indexes[0]) - has)
        if not lacking:
            return candidate
        missing = missing or f"{lacking[0]} of step {candidate}"
    raise DtrainError(f"no checkpoint in {folder} that the hosts left hold whole: "
                      f"{missing or f'step {step}'} is on none of them (checkpoint.copies "
                      "keeps each file on that many hosts beyond its own)")


def _make(target: Path) -> None:
    """The folder a resume's fetched files go into: a listed one, or a fresh hidden one."""
    if target.name.startswith("."):
        shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True, exist_ok=True)


def _list(folder: Path, tmp: Path, final: Path, step: int) -> None:
    """Make the checkpoint fetched into `tmp` visible as `final` and list it, in step order."""
    if final.exists():  # unlisted: left by a save that crashed before listing it
        shutil.rmtree(final)
    tmp.rename(final)
    atomic.fsync(folder)
    entries = [e for e in atomic.read_index(folder) if e["file"] != final.name]
    entries.append({"file": final.name, "step": step, "format": universal.FORMAT})
    entries.sort(key=lambda e: e["step"])
    atomic.replace_index(folder, entries, len(entries))
