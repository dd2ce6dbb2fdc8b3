"""Checkpoints: atomic, checksummed, pruned; a damaged one is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dtrain import checkpoint
from dtrain.errors import DtrainError


def state(step: int) -> dict:
    return {"step": step, "w": torch.full((3,), float(step))}


def test_round_trip_and_keep_last(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, state(step), keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step-*.pt")) == [
        "step-00000002.pt", "step-00000003.pt"]
    assert checkpoint.load(tmp_path)["step"] == 3
    assert torch.equal(checkpoint.load(tmp_path, step=2)["w"], torch.full((3,), 2.0))
    assert not list(tmp_path.glob(".*tmp*"))


def test_corrupted_file_is_refused_by_name(tmp_path: Path) -> None:
    path = checkpoint.save(tmp_path, 5, state(5), keep_last=2)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DtrainError, match=f"{path.name} is corrupted"):
        checkpoint.load(tmp_path)


def test_missing_file_is_named(tmp_path: Path) -> None:
    path = checkpoint.save(tmp_path, 5, state(5), keep_last=2)
    path.unlink()
    with pytest.raises(DtrainError, match=f"{path.name} is missing"):
        checkpoint.load(tmp_path)


def test_crash_during_write_keeps_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint.save(tmp_path, 1, state(1), keep_last=2)

    def crash(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(tmp_path, 2, state(2), keep_last=2)
    monkeypatch.undo()
    assert checkpoint.load(tmp_path)["step"] == 1
    assert not (tmp_path / "step-00000002.pt").exists()
    assert not list(tmp_path.glob(".*tmp*"))


def test_no_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(DtrainError, match="no checkpoint"):
        checkpoint.load(tmp_path)
