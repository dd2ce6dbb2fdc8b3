"""Resume from the newest checkpoint that verifies; a damaged one is moved aside, never
deleted.

    choice = choose(folder)             # the newest that verifies, and the newer ones that do not
    line = fall_back(folder)            # the same, the damaged moved into folder/damaged/

A checkpoint can be damaged after it was published: a disk that flips a bit, a file cut
short by a full disk or a copy, a file deleted by hand. Opening it checks every file it
reads against its SHA-256 (universal.Checkpoint: the index against the digest its
checkpoints folder's index recorded, each other file against the index) and names the one
that is wrong. Refusing the whole resume for it would fail every restart of a job that
resumes by itself; taking the checkpoint before it loses only the steps between the two.
So a resume from a checkpoints folder (`checkpoint.resume = "auto"`, a restart, or the
folder's path) takes the newest checkpoint that verifies, and says in one line what it
skipped and why:

    checkpoint step-00000006 is damaged (rank-00001.safetensors: checksum mismatch): moved
    to checkpoints/damaged/step-00000006; resuming from step-00000004

A path naming one checkpoint is what the user asked for: if it is damaged, it stays an error.

The damaged checkpoints newer than the one taken are moved into `damaged/` inside the
checkpoints folder, then the index is written again without them. Each step is atomic (a
rename on one filesystem, the index replaced as a whole), and in that order: a crash
between them leaves the index listing a folder that is gone, which the next resume finds
missing and unlists; the other order would leave an unlisted folder, which the next save
sweeps away as a crashed save's. Saves and `keep_last` never look inside `damaged/`: what
is there stays until someone removes it. Moving twice is harmless (a second mover finds
the folder gone), so ranks that cannot meet in a collective (live replicas at a job's start)
may each do it.

When no listed checkpoint verifies, nothing is moved and the resume fails naming each:
starting afresh would silently lose the training they hold. A checkpoint of another format
is not a damaged one: it stops the resume, as before.

Hosts without a shared filesystem (dtrain.checkpoint.copies) choose among the copies all
hosts hold, with the same rules and the same line; this module's `move_aside` and
`describe` serve both.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dtrain.checkpoint import atomic
from dtrain.checkpoint.universal import FORMAT, Checkpoint, Damaged, is_checkpoint, nothing_in
from dtrain.errors import DtrainError

DAMAGED = "damaged"
"""The folder inside a checkpoints folder where damaged checkpoints (and damaged files of
a checkpoint whose good copies were fetched from other hosts) are moved."""


@dataclass(frozen=True)
class Skipped:
    """A listed checkpoint that does not verify.

    Attributes:
        name: its folder's name (`step-00000006`).
        file: the first of its files found wrong (`rank-00001.safetensors`).
        what: what is wrong with it, as a refusal says it ("corrupted (checksum mismatch)").
        why: the same in a few words ("checksum mismatch").
    """

    name: str
    file: str
    what: str
    why: str

    @classmethod
    def of(cls, name: str, damaged: Damaged) -> Skipped:
        """The checkpoint `name`, whose opening raised `damaged`."""
        return cls(name, damaged.file.name, damaged.what, damaged.why)


@dataclass(frozen=True)
class Choice:
    """What a resume from a checkpoints folder takes.

    Attributes:
        folder: the checkpoints folder.
        checkpoint: the newest listed checkpoint that verifies (opened: every file checked);
            None when the folder lists none.
        skipped: the newer ones that do not, newest first.
    """

    folder: Path
    checkpoint: Checkpoint | None
    skipped: tuple[Skipped, ...]


def choose(folder: Path) -> Choice:
    """The newest checkpoint `folder` lists that verifies, and the newer ones that do not
    (nothing is moved).

    Raises:
        DtrainError: the folder lists checkpoints and none verifies (each named), one is of
            another format, or the folder's index cannot be read.
    """
    entries = [e for e in atomic.read_index(folder) if e.get("format") == FORMAT]
    skipped: list[Skipped] = []
    for entry in reversed(entries):
        path = folder / entry["file"]
        if not path.is_dir():  # listed, gone: a crash while it was being moved aside
            skipped.append(Skipped(entry["file"], "its folder", "missing", "missing"))
            continue
        try:
            return Choice(folder, Checkpoint(path), tuple(skipped))
        except Damaged as exc:
            skipped.append(Skipped.of(entry["file"], exc))
    if skipped:
        raise none_verifies(folder, skipped)
    return Choice(folder, None, ())


def none_verifies(folder: Path, skipped: Iterable[Skipped]) -> DtrainError:
    """The one line of a resume that found no checkpoint that verifies."""
    each = "; ".join(f"{s.name}: {s.file} is {s.what}" for s in skipped)
    return DtrainError(f"no checkpoint in {folder} verifies ({each}): nothing was moved "
                       "(starting afresh would lose their training); restore a good copy, "
                       "or move the folder away to start afresh")


def open_newest(path: str | Path) -> Checkpoint:
    """The checkpoint `path` names: that checkpoint (damaged or not), or of a checkpoints
    folder, the newest that verifies (nothing moved).

    Raises:
        DtrainError: no checkpoint there, none that verifies, or the one named is damaged
            (`Damaged`) or of another format.
    """
    path = Path(path)
    if is_checkpoint(path):
        return Checkpoint(path)
    choice = choose(path)
    if choice.checkpoint is None:
        raise nothing_in(path)
    return choice.checkpoint


def fall_back(folder: Path) -> str:
    """(One rank, for everyone resuming from `folder`, a checkpoints folder.) Move the
    damaged checkpoints newer than the newest that verifies into `folder`/damaged/;
    returns the line that says so ("" when nothing was skipped).

    Raises:
        DtrainError: as `choose`, with nothing moved.
    """
    choice = choose(folder)
    if not choice.skipped:
        return ""
    assert choice.checkpoint is not None  # choose raises when every one is skipped
    moved = move_aside(folder, [s.name for s in choice.skipped])
    return describe(folder, choice.skipped, moved, choice.checkpoint.path.name)


def move_aside(folder: Path, names: list[str]) -> dict[str, Path | None]:
    """Move the checkpoints `names` of the checkpoints folder `folder` into its damaged/,
    then list the others alone; returns where each went (None: its folder was gone
    already, moved by another rank or lost).

    Raises:
        OSError: a folder could not be moved or the index written.
    """
    moved = {name: aside(folder / name, folder, name) for name in names}
    kept = [e for e in atomic.read_index(folder) if e.get("file") not in names]
    atomic.replace_index(folder, kept, len(kept))
    return moved


def aside(path: Path, folder: Path, name: str) -> Path | None:
    """Move `path` (a checkpoint's folder, or a file of one) to `folder`/damaged/`name`, or
    to `name`.1, .2, ... where that is taken; returns where it went (None: `path` is gone
    already). A rename: atomic, on the same filesystem as `folder`.

    Raises:
        OSError: it could not be moved.
    """
    target = folder / DAMAGED / name
    target.parent.mkdir(parents=True, exist_ok=True)
    copy = 0
    while target.exists():
        copy += 1
        target = target.with_name(f"{Path(name).name}.{copy}")
    try:
        os.rename(path, target)
    except FileNotFoundError:
        return None
    atomic.fsync(target.parent)
    atomic.fsync(path.parent)
    return target


def describe(folder: Path, skipped: Iterable[Skipped], moved: dict[str, Path | None],
             taken: str, where: str = "") -> str:
    """The one line of a resume that skipped damaged checkpoints: each, why, where it went
    (`where`: words after the place, such as "on each host"), and the one `taken`."""
    said = []
    for s in skipped:
        went = moved.get(s.name)
        place = (f"moved to {folder.name}/{went.relative_to(folder)}{where}" if went is not None
                 else "unlisted (its folder is gone)")
        said.append(f"checkpoint {s.name} is damaged ({s.file}: {s.why}): {place}")
    return "; ".join([*said, f"resuming from {taken}"])
