"""Universal checkpoints: the model's logical tensors, written in pieces, read in any layout.

A checkpoint is a folder `step-00000200/` inside the checkpoints folder:

    index.json               per logical tensor: shape, dtype, how tensor parallelism cut
                             it, and where each piece lies (file, key, offsets); the run's
                             layout and metadata (step, config, optimizer options,
                             scheduler); the SHA-256 of every other file
    rank-00000.safetensors   the pieces rank 0 owns, as flat tensors
    rank-00000.json          rank 0's description of them (merged into index.json)
    ...

A *logical tensor* is one tensor of the plain, unparallelized model by its own name:
`model/blocks.0.attn.qkv.weight`, and per-element optimizer state such as
`optim/blocks.0.attn.qkv.weight/exp_avg`. A *piece* is a range [lo, hi) of the flattened
block that one tensor-parallel rank holds (`part` of `parts`, cut by a `Split`); without
tensor parallelism the block is the whole tensor. Every rank writes the pieces it owns:
its ZeRO shard, or its slice of a replicated tensor, so writing is spread over the ranks
and nothing is gathered. Reading assembles one logical tensor at a time from whichever
pieces cover it, so a checkpoint written by dp=2 x tp=2 loads into dp=4, a pipeline, or
one process, and no rank ever holds more than one whole tensor beyond its own state.

Saving is atomic: the ranks write into a hidden `.step-00000200.tmp/`; once all have
written, the first rank writes index.json, renames the folder into place and lists it in
the checkpoints folder's index (dtrain.checkpoint), so a crash at any moment leaves the
previous checkpoint as the newest listed one. The checkpoints folder's index records the
SHA-256 of each checkpoint's index.json, which records those of its other files. Loading
verifies every file against its checksum and names the one that is missing or damaged
(`Damaged`); a resume then takes the newest checkpoint that verifies
(dtrain.checkpoint.fallback).

    dtrain export runs/default/checkpoints model.safetensors   # one plain state_dict
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dtrain import faults
from dtrain.checkpoint import atomic
from dtrain.errors import DtrainError
from dtrain.split import Split

if TYPE_CHECKING:  # comm is imported where save uses it
    from dtrain.comm import GroupLike

FORMAT = "dtrain.universal/1"
INDEX = "index.json"
MODEL, OPTIM = "model/", "optim/"
MISMATCH = "corrupted (checksum mismatch)"


class Damaged(DtrainError):
    """A checkpoint one of whose files is missing or does not verify.

    Attributes:
        file: the file.
        what: what is wrong with it, as the error says it ("corrupted (checksum mismatch)").
        why: the same in a few words ("checksum mismatch", "missing", "unreadable").
    """

    def __init__(self, message: str, file: Path, what: str, why: str) -> None:
        super().__init__(message)
        self.file, self.what, self.why = file, what, why


@dataclass
class Piece:
    """Elements [lo, lo + values.numel()) of the flattened block `part` of `parts` of the
    logical tensor `name` (of `shape`), cut by `split` (None: the block is the tensor)."""

    name: str
    shape: tuple[int, ...]
    values: torch.Tensor
    lo: int = 0
    part: int = 0
    parts: int = 1
    split: Split | None = None

    @classmethod
    def of_block(cls, name: str, block_shape: torch.Size, values: torch.Tensor, lo: int,
                 part: int = 0, parts: int = 1, split: Split | None = None) -> Piece:
        """The piece at `lo` of a block shaped `block_shape` (the logical tensor's shape
        follows from the split)."""
        shape = list(block_shape)
        if split is not None:
            shape[split.dim] *= parts
        return cls(name, tuple(shape), values, lo, part, parts, split)

    @property
    def key(self) -> str:
        return f"{self.name}|{self.part}|{self.lo}"

    def describe(self, file: str) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": str(self.values.dtype),
                "split": None if self.split is None else [self.split.dim, self.split.chunks],
                "parts": self.parts, "part": self.part, "lo": self.lo,
                "hi": self.lo + self.values.numel(), "file": file, "key": self.key}


def pieces_of(name: str, block: torch.Tensor, owner: int = 0, owners: int = 1,
              part: int = 0, parts: int = 1, split: Split | None = None) -> list[Piece]:
    """The piece of `block` (tensor-parallel block `part`, or the whole tensor) that owner
    `owner` of `owners` writes: its contiguous share of the flattened elements."""
    from dtrain.comm.ops import shard_offsets

    flat = block.detach().reshape(-1)
    off = shard_offsets(flat.numel(), owners)
    values = flat[off[owner] : off[owner + 1]]
    if values.numel() == 0 and flat.numel() > 0:
        return []
    return [Piece.of_block(name, block.shape, values.clone(), off[owner], part, parts, split)]


def _name(rank: int, suffix: str) -> str:
    return f"rank-{rank:05d}.{suffix}"


def save(folder: str | Path, step: int, pieces: list[Piece], extra: dict[str, Any],
         meta: dict[str, Any], keep_last: int, group: GroupLike | Literal["world"] = "world",
         rank_tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write this rank's `pieces` into the checkpoint of `step` (collective over `group`,
    default the world; None: this process writes the whole checkpoint alone).

    `extra` (JSON) is merged over all ranks into the index (e.g. optimizer scalars by
    tensor name); `meta` (JSON) is the first rank's description of the run;
    `rank_tensors` (e.g. RNG states) stay per rank, read back with `Checkpoint.rank_tensors`.

    Returns:
        The checkpoint's folder: `step-NNNNNNNN`, or on the first rank `step-NNNNNNNN.K`
        when that step was saved before (the old copy is deleted once the new one is
        listed).

    Raises:
        DtrainError: the checkpoint was not saved; one line says why, and which earlier
            checkpoint is kept.
    """
    from dtrain import comm

    g = None if group is None else comm.resolve(None if group == "world" else group)
    rank, size = (0, 1) if g is None else (g.rank, g.size)
    folder = Path(folder)
    tmp = unpublished(folder, step)
    final = folder / f"step-{step:08d}"
    if rank == 0:
        prepare(folder, step)
    if g is not None:
        comm.barrier(group=g)
    try:
        write_rank(tmp, rank, pieces, extra, rank_tensors)
        if g is not None:
            comm.barrier(group=g)
        if rank == 0:
            final = publish(folder, step, size, meta, keep_last)
    except (OSError, SafetensorError) as exc:
        # Disk full, quota, read-only: the unfinished folder goes.
        shutil.rmtree(tmp, ignore_errors=True)
        raise not_saved(folder, step, exc) from None
    if g is not None:
        comm.barrier(group=g)
    return final


def unpublished(folder: Path, step: int) -> Path:
    """The hidden folder the ranks write the checkpoint of `step` into."""
    return folder / f".step-{step:08d}.tmp"


def prepare(folder: Path, step: int) -> None:
    """(The first rank, before the others write.) Remove what crashed saves left (folders
    the index does not list) and make the hidden folder of `step`.

    Raises:
        DtrainError: the folder cannot be made (the one line of `not_saved`).
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
        listed = {e["file"] for e in atomic.read_index(folder)}
        for stale in [*folder.glob(".step-*.tmp"), *folder.glob("step-*")]:
            if stale.is_dir() and stale.name not in listed:  # left by crashed saves
                shutil.rmtree(stale, ignore_errors=True)
        unpublished(folder, step).mkdir()
    except OSError as exc:
        raise not_saved(folder, step, exc) from None


def write_rank(tmp: Path, rank: int, pieces: list[Piece], extra: dict[str, Any],
               rank_tensors: dict[str, torch.Tensor] | None) -> None:
    """Write and flush rank `rank`'s two files into the hidden folder `tmp`: its pieces
    (and `rank_tensors`), and their description with the data file's checksum.

    Raises:
        OSError, SafetensorError: a file could not be written (the caller says so).
    """
    tensors = {p.key: p.values.contiguous() for p in pieces}
    tensors.update({f"rank/{k}": v.contiguous() for k, v in (rank_tensors or {}).items()})
    data = tmp / _name(rank, "safetensors")
    save_file(tensors, str(data))
    atomic.fsync(data)
    side = {"pieces": [p.describe(data.name) for p in pieces], "extra": extra,
            "sha256": atomic.sha256(data)}
    (tmp / _name(rank, "json")).write_text(json.dumps(side))
    atomic.fsync(tmp / _name(rank, "json"))
    faults.at("save")


def not_saved(folder: Path, step: int, exc: Exception) -> DtrainError:
    """The one line a failed save ends a run with: why, and what is still there."""
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    why = why.rpartition("I/O error: ")[2]  # safetensors': "...: I/O error: File too large"
    entries = [e for e in atomic.read_index(folder) if e.get("format") == FORMAT]
    kept = (f"the previous checkpoint {folder / entries[-1]['file']} is kept" if entries
            else "there is no earlier checkpoint")
    return DtrainError(f"checkpoint of step {step} not saved in {folder}: {why}; {kept}")


def description(tmp: Path, rank: int) -> dict[str, Any]:
    """Rank `rank`'s description in the hidden folder `tmp` (its rank-NNNNN.json), with
    that file's own digest under "json_sha256" (raises OSError)."""
    side_path = tmp / _name(rank, "json")
    return {**json.loads(side_path.read_text()), "json_sha256": atomic.sha256(side_path)}


def publish(folder: Path, step: int, size: int, meta: dict[str, Any], keep_last: int | None,
            sides: list[dict[str, Any]] | None = None,
            copies: dict[str, Any] | None = None) -> Path:
    """(The first rank, once all `size` ranks have written.) Merge the ranks' descriptions
    (`sides`, as `description` reads them; read from the hidden folder when None) into
    index.json, make the folder visible, list it and drop all but the newest `keep_last`
    (None: drop nothing yet); returns where it now is (raises OSError). `copies`: where
    each file lies when hosts keep copies (dtrain.checkpoint.copies), into the index."""
    tmp = unpublished(folder, step)
    tensors: dict[str, dict[str, Any]] = {}
    files: dict[str, str] = {}
    extra: dict[str, Any] = {}
    if sides is None:
        sides = [description(tmp, rank) for rank in range(size)]
    for rank, side in enumerate(sides):
        files[_name(rank, "safetensors")] = side["sha256"]
        files[_name(rank, "json")] = side["json_sha256"]
        for key, value in side["extra"].items():
            extra.setdefault(key, {}).update(value)
        for p in side["pieces"]:
            entry = tensors.setdefault(p["name"], {
                "shape": p["shape"], "dtype": p["dtype"], "split": p["split"],
                "parts": p["parts"], "pieces": []})
            entry["pieces"].append({k: p[k] for k in ("part", "lo", "hi", "file", "key")})
    index = {"format": FORMAT, "step": step, "world_size": size, "meta": meta,
             "extra": extra, "tensors": tensors, "files": files,
             **({"copies": copies} if copies else {})}
    (tmp / INDEX).write_text(json.dumps(index, indent=1))
    atomic.fsync(tmp / INDEX)
    atomic.fsync(tmp)
    return place(folder, step, keep_last)


def place(folder: Path, step: int, keep_last: int | None, by_step: bool = False) -> Path:
    """Make the whole checkpoint of `step` in its hidden folder (files and index.json,
    flushed) visible and list it as the newest (`by_step`: in step order, for a copy that
    may arrive after a newer save), with its index's digest; then drop all but the newest
    `keep_last` (None: drop nothing yet). Returns where it now is (raises OSError). A save
    publishes so, and so does a copy received from another host
    (dtrain.checkpoint.live_copies), in another thread of the same process: the index is
    read and written again by one of them at a time."""
    with _placing:
        return _place(folder, step, keep_last, by_step)


_placing = threading.Lock()


def _place(folder: Path, step: int, keep_last: int | None, by_step: bool) -> Path:
    tmp = unpublished(folder, step)
    final = folder / f"step-{step:08d}"
    listed = atomic.read_index(folder)
    again = [e for e in listed if e.get("step") == step and e.get("format") == FORMAT]
    # The step saved before (a resumed run): the new copy gets a name of its own, and the
    # old one goes only once the index lists the new one.
    target = final
    copy = 0
    while target.exists():
        copy += 1
        target = folder / f"{final.name}.{copy}"
    os.replace(tmp, target)
    atomic.fsync(folder)
    entries = [e for e in listed if e not in again]
    entries.append(listing(target.name, step, atomic.sha256(target / INDEX)))
    if by_step:
        entries.sort(key=lambda e: e.get("step", -1))
    atomic.replace_index(folder, entries, len(entries) if keep_last is None else keep_last)
    for entry in again:
        shutil.rmtree(folder / entry["file"], ignore_errors=True)
    return target


def listing(name: str, step: int, index_sha256: str) -> dict[str, Any]:
    """The entry of the checkpoint folder `name` in its checkpoints folder's index: its
    step, format, and the SHA-256 of its index.json (which holds those of its other files)."""
    return {"file": name, "step": step, "format": FORMAT, "sha256": index_sha256}


def is_checkpoint(path: Path) -> bool:
    """Whether `path` is one checkpoint's folder (damaged or not), rather than a checkpoints
    folder.

    Raises:
        DtrainError: it is a checkpoint of another format.
    """
    own = path / INDEX
    if not own.exists():  # a checkpoint that lost its index is still one
        return path.name.startswith("step-") and path.is_dir()
    data = _own_index(path)
    if isinstance(data, dict) and "format" in data:
        _check_format(own, data)
        return True
    return not (isinstance(data, dict) and "checkpoints" in data) and (
        path.name.startswith("step-") or any(path.glob("rank-*.safetensors")))


def latest(path: str | Path) -> Path:
    """The checkpoint folder `path` names: itself if it is one, else the newest listed in
    the checkpoints folder `path`.

    Raises:
        DtrainError: nothing there is a checkpoint, or it is of another format.
    """
    path = Path(path)
    if is_checkpoint(path):
        return path  # if damaged, Checkpoint() names what is wrong
    entries = [e for e in atomic.read_index(path) if e.get("format") == FORMAT]
    if not entries:
        raise nothing_in(path)
    return path / entries[-1]["file"]


def step_of(name: str) -> int:
    """The step of a checkpoint folder's name (`step-00000200`, or `step-00000200.1`)."""
    return int(name.removeprefix("step-").split(".")[0])


def folder_and_step(where: str | Path) -> tuple[Path, int | None]:
    """What a resume from `where` means: (the checkpoints folder, the step of the one
    checkpoint it names, or None for the newest)."""
    where = Path(where)
    if where.name.startswith("step-"):
        return where.parent, step_of(where.name)
    return where, None


def nothing_in(path: Path) -> DtrainError:
    """The error for a folder that holds no checkpoint."""
    return DtrainError(f"no checkpoint in {path}: give a checkpoints folder or one "
                       "step-NNNNNNNN folder in it")


def _own_index(path: Path) -> object:
    """The JSON of `path`/index.json: a checkpoint's, a checkpoints folder's, or None (no
    file, or not JSON)."""
    try:
        return json.loads((path / INDEX).read_text())
    except (OSError, ValueError):
        return None


def _check_format(index: Path, data: object) -> None:
    """Refuse an index of another format (or none), by name."""
    if not isinstance(data, dict) or "format" not in data:
        raise DtrainError(f"{index} is not a {FORMAT} checkpoint")
    if data["format"] != FORMAT:
        raise DtrainError(f"{index} is a {data['format']!r} checkpoint; this dtrain reads "
                          f"{FORMAT}")


def of_step(path: Path, step: int) -> Path | None:
    """The checkpoint of `step` at `path` (a checkpoint folder, or a checkpoints folder
    listing it); None where there is none."""
    data = _own_index(path)
    if isinstance(data, dict) and "format" in data:
        return path if data.get("step") == step else None
    found = [e for e in atomic.read_index(path) if e.get("format") == FORMAT
             and e.get("step") == step]
    return path / found[-1]["file"] if found else None


def recorded_sha256(path: Path) -> str | None:
    """The SHA-256 of the checkpoint `path`'s index.json as its checkpoints folder's index
    records it; None where it is not listed there, or listed without one (an older
    dtrain's), or that index cannot be read (opening a checkpoint by its own path does
    not need it)."""
    try:
        entries = atomic.read_index(path.parent)
    except DtrainError:
        return None
    found = [e.get("sha256") for e in entries if e.get("file") == path.name]
    return found[-1] if found and isinstance(found[-1], str) else None


def previous(path: Path) -> Path | None:
    """The checkpoint listed before `path` in its folder's index, if any."""
    entries = [e for e in atomic.read_index(path.parent) if e.get("format") == FORMAT]
    names = [e["file"] for e in entries]
    if path.name in names and names.index(path.name) > 0:
        return path.parent / names[names.index(path.name) - 1]
    return None


class Checkpoint:
    """A universal checkpoint opened for reading; every file is checked first.

    Args:
        path: a checkpoint folder, or a checkpoints folder (its newest checkpoint).
        also: more folders of the same kind where files it lacks may lie: other hosts'
            copies of a checkpoint saved with checkpoint.copies (dtrain.checkpoint.copies).
            Their checkpoint of the same step is used.

    Raises:
        Damaged: one of its files is missing or damaged (the message names it, and the
            previous checkpoint if there is one).
        DtrainError: no checkpoint there, or one of another format.
    """

    def __init__(self, path: str | Path, also: Sequence[str | Path] = ()) -> None:
        self.path = latest(path)
        self.index = self._verified_index()
        others = [of_step(Path(o), self.index["step"]) for o in also]
        self._where: dict[str, Path] = {}
        for name, digest in self.index["files"].items():
            places = [p for p in (self.path / name, *(o / name for o in others if o))
                      if p.exists()]
            if not places:
                raise self._damaged(self.path / name, "missing" + self._elsewhere(), "missing")
            good = next((p for p in places if atomic.sha256(p) == digest), None)
            if good is None:
                raise self._damaged(places[0], MISMATCH, "checksum mismatch")
            self._where[name] = good
        self.step: int = self.index["step"]
        self.meta: dict[str, Any] = self.index["meta"]
        self.extra: dict[str, Any] = self.index["extra"]
        self.tensors: dict[str, dict[str, Any]] = self.index["tensors"]
        self._open: dict[str, Any] = {}
        self._cache: tuple[str, torch.Tensor] | None = None

    def _verified_index(self) -> dict[str, Any]:
        """The checkpoint's index.json, read and checked: of this format, whole, and with
        the SHA-256 its checkpoints folder's index recorded for it (where it did: an older
        dtrain recorded none). The format is checked first: a checkpoint of another
        version is not a damaged one."""
        index = self.path / INDEX
        if not index.exists():
            raise self._damaged(index, "missing", "missing")
        try:
            raw = index.read_bytes()
            data = json.loads(raw)
        except (OSError, ValueError) as exc:
            raise self._damaged(index, f"unreadable ({exc})", "unreadable") from None
        _check_format(index, data)
        lacking = [k for k in ("files", "step", "meta", "extra", "tensors") if k not in data]
        if lacking:
            what = f"incomplete (no {', '.join(map(repr, lacking))})"
            raise self._damaged(index, what, what)
        recorded = recorded_sha256(self.path)
        if recorded is not None and hashlib.sha256(raw).hexdigest() != recorded:
            raise self._damaged(index, MISMATCH, "checksum mismatch")
        return data

    def _damaged(self, file: Path, what: str, why: str) -> Damaged:
        before = previous(self.path)
        hint = f"; the previous checkpoint is {before}" if before else ""
        return Damaged(f"checkpoint file {file} is {what}: this checkpoint cannot be "
                       f"loaded{hint}", file, what, why)

    def _elsewhere(self) -> str:
        """Where a file missing here may be: other hosts' folders, for a checkpoint whose
        hosts keep copies."""
        copies = self.index.get("copies")
        if not copies:
            return ""
        count = copies.get("copies", copies.get("replicate"))  # (an older dtrain's name)
        return (f" here (saved with checkpoint.copies = {count}: other "
                "hosts' folders hold it; give them too, as in dtrain export FOLDER "
                "OTHER_FOLDER... OUT)")

    def _file(self, name: str) -> safe_open:
        if name not in self._open:
            self._open[name] = safe_open(str(self._where[name]), framework="pt")
        return self._open[name]

    def names(self, prefix: str = MODEL) -> list[str]:
        """The logical tensors under `prefix` (model/ or optim/), prefix removed."""
        return [n[len(prefix):] for n in self.tensors if n.startswith(prefix)]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str) -> torch.Tensor:
        """The whole logical tensor `name`, assembled from its pieces.

        Raises:
            DtrainError: the tensor is not in the checkpoint, or its pieces leave a gap.
        """
        if self._cache is not None and self._cache[0] == name:
            return self._cache[1]
        if name not in self.tensors:
            raise DtrainError(f"checkpoint {self.path} has no tensor {name!r}: was it saved "
                              "from another model?")
        entry = self.tensors[name]
        shape, parts = entry["shape"], entry["parts"]
        numel = 1
        for n in shape:
            numel *= n
        per_part = numel // parts
        dtype = getattr(torch, entry["dtype"].removeprefix("torch."))
        blocks = [torch.empty(per_part, dtype=dtype) for _ in range(parts)]
        covered = [0] * parts
        for p in entry["pieces"]:
            blocks[p["part"]][p["lo"] : p["hi"]] = self._file(p["file"]).get_tensor(p["key"])
            covered[p["part"]] += p["hi"] - p["lo"]
        if any(c != per_part for c in covered):
            raise DtrainError(f"checkpoint {self.path}: the pieces of {name!r} do not cover it")
        if entry["split"] is None:
            whole = blocks[0].view(shape)
        else:
            split = Split(*entry["split"])
            block_shape = list(shape)
            block_shape[split.dim] //= parts
            whole = split.join([b.view(block_shape) for b in blocks])
        self._cache = (name, whole)
        return whole

    def model_state(self) -> dict[str, torch.Tensor]:
        """The whole model's state_dict: every tensor under `model/`, and each tied
        weight under its other names too (the same tensor); of an adapter checkpoint,
        the adapters alone (dtrain.adapters.checkpoints)."""
        state = {name: self.tensor(MODEL + name) for name in self.names(MODEL)}
        return state | {alias: state[name]
                        for alias, name in self.meta.get("aliases", {}).items() if name in state}

    def rank_tensors(self, rank: int) -> dict[str, torch.Tensor]:
        """The tensors rank `rank` kept for itself (e.g. RNG states)."""
        file = self._file(_name(rank, "safetensors"))
        return {k[len("rank/"):]: file.get_tensor(k) for k in file.keys()
                if k.startswith("rank/")}


def export(path: str | Path, out: str | Path, also: Sequence[str | Path] = ()) -> Path:
    """Write the model of a checkpoint as one plain state_dict file (`.safetensors` or
    `.pt`) that loads into the unparallelized model with `load_state_dict`; `also`: other
    hosts' folders holding the files `path` lacks (as `Checkpoint` takes them).

    Raises:
        DtrainError: not a checkpoint, a damaged one, or an unknown output suffix.
    """
    out = Path(out)
    if out.suffix not in (".safetensors", ".pt"):
        raise DtrainError(f"dtrain export: {out} must end in .safetensors or .pt")
    ckpt = Checkpoint(path, also)
    state = ckpt.model_state()
    if out.suffix == ".safetensors":  # it stores no tensor twice: tied weights as copies
        state = {name: tensor.clone() for name, tensor in state.items()}
    tmp = out.with_name(f".{out.name}.tmp")
    if out.suffix == ".pt":
        torch.save(state, tmp)
    else:
        save_file(state, str(tmp), metadata={"step": str(ckpt.step)})
    os.replace(tmp, out)
    return out

