"""`dtrain data prepare`, then `dtrain train` on its shards and `dtrain export`: the three
commands of docs/models.md, end to end, as a user runs them."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import torch

from dtrain.checkpoint import universal
from tests.data.test_data import make_tokenizer
from tests.support.cli import dtrain, one_error_line

RUN = """
[model]
arch = "llama"
n_layer = 1
n_head = 2
n_embd = 32
ffn_hidden = 64
block_size = 32

[optimizer]
lr = 1e-2
warmup_steps = 2

[train]
steps = 4
batch_size = 8
eval_every = 0
eval_batches = 2

[logging]
sample_tokens = 8
sample_prompt = "import "
"""


def corpus(folder: Path) -> Path:
    """A few of Python's own source files (about 100 kB)."""
    folder.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("abc.py", "bisect.py", "colorsys.py", "copy.py", "fnmatch.py", "glob.py"):
        shutil.copy(stdlib / name, folder / name)
    return folder


def train(folder: Path, name: str, *sets: str) -> tuple[list[float], Path, str]:
    config = folder / f"{name}.toml"
    config.write_text(RUN)
    args = [x for s in sets for x in ("--set", s)]
    result = dtrain("train", str(config), "-n", "1", *args, "--set",
                    f"train.out_dir='{folder / name}'", "--metrics",
                    str(folder / f"{name}.jsonl"), timeout=170)
    assert result.returncode == 0, result.stdout + result.stderr
    losses = [r["loss"] for r in map(json.loads, (folder / f"{name}.jsonl").read_text()
                                     .splitlines()) if "loss" in r]
    return losses, folder / name / "checkpoints", result.stdout


def test_prepare_train_export(tmp_path: Path) -> None:
    """Shards prepared with a tokenizer file train exactly as the text they came from does
    (same ids, same order); the model's vocabulary is the tokenizer's; the export carries
    the tokenizer."""
    texts = corpus(tmp_path / "texts")
    tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
    shards = tmp_path / "shards"
    result = dtrain("data", "prepare", str(texts), str(shards), "--tokenizer", str(tokenizer),
                    "--workers", "2", "--shard-size", "10000")
    assert result.returncode == 0, result.stderr
    index = json.loads((shards / "index.json").read_text())
    assert index["dtype"] == "uint16" and len(index["shards"]) > 1

    from_shards = train(tmp_path, "shards", "data.format='tokens'", f"data.path='{shards}'")
    from_text = train(tmp_path, "text", f"data.path='{texts}'",
                      f"data.tokenizer='{tokenizer}'")
    assert from_shards[0] == from_text[0]
    ckpt = universal.Checkpoint(from_shards[1])
    vocab = ckpt.meta["model"]["vocab_size"]
    assert vocab == index["vocab_size"] and ckpt.tensor("model/embed.weight").shape[0] == vocab
    assert "sample:\nimport " in from_shards[2]

    out = tmp_path / "hf"
    assert dtrain("export", str(from_shards[1]), str(out), "--format", "hf").returncode == 0
    assert (out / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    ids = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))(
        "import os", return_tensors="pt").input_ids
    logits = AutoModelForCausalLM.from_pretrained(out)(ids).logits
    assert logits.shape == (1, ids.shape[1], vocab) and torch.isfinite(logits).all()


def test_prepare_mistakes_are_one_line(tmp_path: Path) -> None:
    """A missing input, a tokenizer that does not parse, an output that is not empty:
    exit 2, one line, nothing written."""
    texts = corpus(tmp_path / "texts")
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    cases = [([str(tmp_path / "nope"), str(tmp_path / "a")], "nope"),
             ([str(texts), str(tmp_path / "b"), "--tokenizer", str(tmp_path / "bad.json")],
              "bad.json"),
             ([str(texts), str(tmp_path / "full")], "full")]
    for args, words in cases:
        result = dtrain("data", "prepare", *args)
        assert result.returncode == 2 and words in one_error_line(result), result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json", "full", "texts"]
