"""A machine's server snapshots carried in its first worker's checkpoint files, so that
hosts without a shared filesystem keep them as they keep checkpoints.

With `[checkpoint] copies = K` every host writes into its own `train.out_dir`, and the
workers' checkpoint files go to K other hosts too (dtrain.checkpoint.copies.HostCopies).
The servers' snapshots (dtrain.ps.shard: values, optimizer state, clocks) lie in
`out_dir/ps-snapshots` of the host they run on, so a lost disk would lose them. The first
worker of each host therefore carries, in the tensors of its own that every checkpoint
keeps (a RankExtra of dtrain.layouts.state: what a rank keeps for itself), the newest
snapshot of each server of its host: the file's bytes and its entry in the folder's
index (with its SHA-256), one uint8 tensor each. They travel with its checkpoint files
to the other hosts. At a resume (HostCopies fills in what a host lacks) it writes back
each snapshot its host's folder lacks or holds older, checked against its SHA-256; the
servers, which look for snapshots again when worker 0 seeds them, resume from it.
Nothing is unpickled: a snapshot is read as checkpoints are (torch.load, weights only).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dtrain.checkpoint import atomic
from dtrain.errors import DtrainError

PREFIX = "ps-snapshots/"


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(0, dtype=torch.uint8)


class HostSnapshots:
    """The snapshots of the servers in `slots` (those of this worker's host), in folder
    `snapshot_dir`, as a rank's own checkpoint tensors (keys `ps-snapshots/...`)."""

    def __init__(self, snapshot_dir: str | Path, slots: range) -> None:
        self.folder, self.slots = Path(snapshot_dir), slots

    def _folders(self) -> list[Path]:
        """Each snapshot folder of this host's servers (their own shard's, and their
        copies' of other shards)."""
        found: list[Path] = []
        for slot in self.slots:
            found += [self.folder / f"server-{slot}",
                      *sorted(self.folder.glob(f"server-{slot}-shard-*"))]
        return [f for f in found if f.is_dir()]

    def state(self) -> dict[str, torch.Tensor]:
        """The newest snapshot of each folder: its file and its index entry."""
        carried = {}
        for folder in self._folders():
            entries = atomic.read_index(folder)
            if not entries:
                continue
            entry = entries[-1]
            key = f"{PREFIX}{folder.name}/"
            carried[key + "file"] = _tensor((folder / entry["file"]).read_bytes())
            carried[key + "entry"] = _tensor(json.dumps(entry).encode())
        return carried

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Write back each carried snapshot the host's folder lacks or holds older.

        Raises:
            DtrainError: a carried snapshot does not match its SHA-256.
        """
        for key in sorted(state):
            if not key.startswith(PREFIX) or not key.endswith("/entry"):
                continue
            name = key[len(PREFIX):-len("/entry")]
            entry = json.loads(_bytes(state[key]))
            folder = self.folder / name
            listed = atomic.read_index(folder) if folder.is_dir() else []
            if listed and listed[-1]["step"] >= entry["step"]:
                continue
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / entry["file"]
            data = _bytes(state[f"{PREFIX}{name}/file"])
            atomic.write_atomic(path, lambda f, d=data: f.write(d))
            if atomic.sha256(path) != entry["sha256"]:
                path.unlink()
                raise DtrainError(f"the copy of parameter-server snapshot {path} carried in "
                                  "the checkpoint does not match its checksum")
            atomic.replace_index(folder, [*listed, entry], keep_last=2)
