"""Checkpoints (single files and universal ones): atomic, checksummed, pruned; a damaged
one is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dtrain.checkpoint import atomic, universal
from dtrain.errors import DtrainError
from dtrain.split import Split


def state(step: int) -> dict:
    return {"step": step, "w": torch.full((3,), float(step))}


def test_round_trip_and_keep_last(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        atomic.save(tmp_path, step, state(step), keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step-*.pt")) == [
        "step-00000002.pt", "step-00000003.pt"]
    assert atomic.load(tmp_path)["step"] == 3
    assert torch.equal(atomic.load(tmp_path, step=2)["w"], torch.full((3,), 2.0))
    assert not list(tmp_path.glob(".*tmp*"))


def test_corrupted_file_is_refused_by_name(tmp_path: Path) -> None:
    path = atomic.save(tmp_path, 5, state(5), keep_last=2)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DtrainError, match=f"{path.name} is corrupted"):
        atomic.load(tmp_path)


def test_missing_file_is_named(tmp_path: Path) -> None:
    path = atomic.save(tmp_path, 5, state(5), keep_last=2)
    path.unlink()
    with pytest.raises(DtrainError, match=f"{path.name} is missing"):
        atomic.load(tmp_path)


def test_crash_during_write_keeps_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    atomic.save(tmp_path, 1, state(1), keep_last=2)

    def crash(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(atomic.torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        atomic.save(tmp_path, 2, state(2), keep_last=2)
    monkeypatch.undo()
    assert atomic.load(tmp_path)["step"] == 1
    assert not (tmp_path / "step-00000002.pt").exists()
    assert not list(tmp_path.glob(".*tmp*"))


def test_no_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(DtrainError, match="no checkpoint"):
        atomic.load(tmp_path)


# ----------------------------------------------------------------- universal checkpoints
def universal_save(folder: Path, step: int, parts: int = 2) -> Path:
    """A checkpoint of one 4x6 tensor cut by columns over `parts` tp ranks, each block
    written as two ranges (as two data-parallel owners would)."""
    whole = torch.arange(24, dtype=torch.float32).view(4, 6) + step
    split = Split(dim=1)
    pieces = []
    for part in range(parts):
        block = split.shard(whole, part, parts)
        for owner in range(2):
            pieces += universal.pieces_of("model/w", block, owner, 2, part, parts, split)
    return universal.save(folder, step, pieces, {"scalars": {"w": {"step": float(step)}}},
                          {"aliases": {"v": "w"}}, keep_last=2, group=None)


def test_universal_round_trip_reassembles_and_keeps_last(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        universal_save(tmp_path, step)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "index.json", "step-00000002", "step-00000003"]
    ckpt = universal.Checkpoint(tmp_path)
    assert ckpt.step == 3 and ckpt.extra["scalars"]["w"]["step"] == 3.0
    torch.testing.assert_close(ckpt.tensor("model/w"),
                               torch.arange(24, dtype=torch.float32).view(4, 6) + 3)
    state = torch.load(universal.export(tmp_path, tmp_path / "m.pt"), weights_only=True)
    assert torch.equal(state["v"], state["w"])


@pytest.mark.parametrize("damage", ["corrupt", "remove"])
def test_universal_damaged_file_is_named_and_previous_still_loads(tmp_path: Path,
                                                                  damage: str) -> None:
    universal_save(tmp_path, 1)
    newest = universal_save(tmp_path, 2)
    target = newest / "rank-00000.safetensors"
    if damage == "remove":
        target.unlink()
    else:
        data = bytearray(target.read_bytes())
        data[-3] ^= 0xFF
        target.write_bytes(bytes(data))
    word = "missing" if damage == "remove" else "corrupted"
    with pytest.raises(DtrainError, match=f"{target.name} is {word}.*previous checkpoint is "
                                          f".*step-00000001"):
        universal.Checkpoint(tmp_path)
    assert universal.Checkpoint(tmp_path / "step-00000001").step == 1


def test_universal_crash_while_writing_keeps_previous(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    universal_save(tmp_path, 1)

    def crash(tensors, path, metadata=None):
        Path(path).write_bytes(b"partial")
        raise OSError("No space left on device")

    monkeypatch.setattr(universal, "save_file", crash)
    with pytest.raises(DtrainError, match="checkpoint of step 2 not saved in .*: No space left "
                                          "on device; the previous checkpoint .*step-00000001 "
                                          "is kept"):
        universal_save(tmp_path, 2)
    monkeypatch.undo()
    assert universal.Checkpoint(tmp_path).step == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.json", "step-00000001"]
