"""Hugging Face datasets as people keep them (save_to_disk folders, parquet files) read
wherever JSON lines are: the same documents, rows and shards as the JSON lines of the same
records give."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dtrain.data.dataset import open_data
from dtrain.data.prepare import prepare
from dtrain.errors import ConfigError
from dtrain.testing.chat import CONVERSATIONS, make_chat_tokenizer, write_chat_jsonl

datasets = pytest.importorskip("datasets")


def _same_rows(a, b) -> None:
    assert len(a) == len(b) > 0
    for i in range(len(a)):
        for x, y in zip(a[i], b[i], strict=True):
            assert torch.equal(x, y), i


@pytest.mark.parametrize("kind", ["saved", "saved splits", "parquet"])
def test_a_chat_dataset_gives_the_rows_its_json_lines_give(tmp_path: Path, kind: str) -> None:
    file = make_chat_tokenizer(tmp_path / "tok")
    rows = [{"conversation": c, "id": i} for i, c in enumerate(CONVERSATIONS * 4)]
    table = datasets.Dataset.from_list(rows)
    path = tmp_path / "set"
    if kind == "saved":
        table.save_to_disk(str(path))
    elif kind == "saved splits":
        datasets.DatasetDict({"train": table, "test": table.select([0])}).save_to_disk(str(path))
    else:
        path.mkdir()
        table.select(range(6)).to_parquet(str(path / "a.parquet"))
        table.select(range(6, len(rows))).to_parquet(str(path / "b.parquet"))
    lines = write_chat_jsonl(tmp_path / "c.jsonl", CONVERSATIONS * 4)
    want = open_data(str(lines), "chat", str(file), block_size=48, val_fraction=0.25)
    got = open_data(str(path), "chat", str(file), block_size=48, val_fraction=0.25,
                    column="conversation")
    _same_rows(got.train, want.train)
    summary = prepare([str(path)], str(tmp_path / "shards"), str(file), workers=2,
                      progress=False, format="chat", column="conversation")
    assert summary["documents"] == len(rows)
    mapped = open_data(str(tmp_path / "shards"), "tokens", block_size=48, val_fraction=0.25)
    _same_rows(mapped.train, want.train)


def test_a_text_dataset_and_its_column(tmp_path: Path) -> None:
    texts = ["first document here", "the second one", "and a third"]
    datasets.Dataset.from_dict({"body": texts}).to_parquet(str(tmp_path / "t.parquet"))
    lines = tmp_path / "t.jsonl"
    lines.write_text("".join(f'{{"text": "{t}"}}\n' for t in texts))
    want = open_data(str(lines), "jsonl", block_size=8, val_fraction=0.2)
    got = open_data(str(tmp_path / "t.parquet"), "jsonl", block_size=8, val_fraction=0.2,
                    column="body")
    _same_rows(got.train, want.train)
    with pytest.raises(ConfigError, match='no "text" field \\(it has body\\)'):
        open_data(str(tmp_path / "t.parquet"), "jsonl", block_size=8)


def test_a_missing_split_is_named(tmp_path: Path) -> None:
    table = datasets.Dataset.from_list([{"messages": c} for c in CONVERSATIONS])
    datasets.DatasetDict({"test": table}).save_to_disk(str(tmp_path / "set"))
    with pytest.raises(ConfigError, match="has no split 'train': give data.split"):
        open_data(str(tmp_path / "set"), "chat", "bytes", chat_template="{{ 'x' }}")
