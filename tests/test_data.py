"""Reading a corpus (a user's file or folder, or the stdlib) and cutting it into sequences."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dtrain.errors import ConfigError
from dtrain.train.data import ByteSequences, read_corpus, split


def test_folder_of_text_files_is_read_in_order(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("third")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "skip.bin").write_bytes(b"\0\1\2")
    assert read_corpus(str(tmp_path), 1000) == b"first\nsecond\nthird"
    assert read_corpus(str(tmp_path / "a.txt"), 3) == b"fir"


def test_stdlib_is_the_default_corpus() -> None:
    data = read_corpus("", 50_000)
    assert len(data) == 50_000 and b"def " in data


def test_empty_and_missing_paths(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match="holds no text"):
        read_corpus(str(tmp_path / "empty.txt"), 100)
    with pytest.raises(ConfigError, match="does not exist"):
        read_corpus(str(tmp_path / "nope"), 100)


def test_sequences_predict_the_next_byte() -> None:
    data = ByteSequences(b"abcdefghij", block_size=4)
    assert len(data) == 2
    x, y = data[1]
    assert bytes(x.tolist()) == b"efgh" and bytes(y.tolist()) == b"fghi"
    assert x.dtype == torch.long


def test_split_needs_a_sequence_on_both_sides() -> None:
    train, val = split(b"x" * 100, 0.2, block_size=10)
    assert (len(train), len(val)) == (80, 20)
    with pytest.raises(ConfigError, match="too few for model.block_size = 30"):
        split(b"x" * 100, 0.2, block_size=30)
