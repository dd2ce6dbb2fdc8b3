"""`dtrain train` end to end on a tiny config, and its answers to bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dtrain import checkpoint
from tests.cli import dtrain, one_error_line

TINY = """
[model]
n_layer = 1
n_head = 2
n_embd = 32
block_size = 32

[data]
max_bytes = 200000

[optimizer]
lr = 1e-2
warmup_steps = 5

[train]
steps = 40
batch_size = 16
eval_every = 20
eval_batches = 2

[logging]
log_every = 10
sample_tokens = 20
"""


def test_tiny_run_learns_and_records(tmp_path: Path) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    metrics = tmp_path / "metrics.jsonl"
    result = dtrain("train", str(config), "--set", f"train.out_dir='{tmp_path / 'run'}'",
                    "--metrics", str(metrics), timeout=170)
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    assert [r["step"] for r in records if "eval_loss" in r] == [20, 40]
    saved = checkpoint.load(tmp_path / "run" / "checkpoints")
    assert saved["step"] == 40 and "wte.weight" in saved["model"]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["steps"] == 40
    assert "sample:" in result.stdout and "step    40/40" in result.stdout
    assert "[rank1]" not in result.stdout  # rank 1 trains silently


def test_zero_stage_3_run_learns_and_writes_shards(tmp_path: Path) -> None:
    """[parallel] zero = 3 in bf16 with two micro-batches: the loss falls, every rank's shard
    lands in the checkpoint, and they reload on another world size (test_zero covers that)."""
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.replace("steps = 40", "steps = 20").replace("eval_every = 20",
                                                                        "eval_every = 0"))
    metrics = tmp_path / "metrics.jsonl"
    result = dtrain("train", str(config), "--set", f"train.out_dir='{tmp_path / 'run'}'",
                    "--set", "parallel.zero=3", "--set", "parallel.mixed_precision='bf16'",
                    "--set", "train.grad_accum=2", "--metrics", str(metrics), timeout=170)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ZeRO stage 3 over 2" in result.stdout and "sample:" in result.stdout
    losses = [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3
    shards = checkpoint.load_shards(tmp_path / "run" / "checkpoints")
    assert [s["zero"]["rank"] for s in shards] == [0, 1] and shards[0]["step"] == 20


def short_run(folder: Path, name: str, args: list[str]) -> tuple[list[float], Path, str]:
    """Six steps of a two-layer TINY: (losses, checkpoint folder, stdout)."""
    config = folder / "tiny.toml"
    config.write_text(TINY.replace("steps = 40", "steps = 6").replace("eval_every = 20",
                                                                       "eval_every = 0"))
    metrics = folder / f"{name}.jsonl"
    result = dtrain("train", str(config), *args, "--set", "model.n_layer=2", "--set",
                    f"train.out_dir='{folder / name}'", "--set", "logging.sample_tokens=0",
                    "--metrics", str(metrics), timeout=170)
    assert result.returncode == 0, result.stdout + result.stderr
    losses = [r["loss"] for r in map(json.loads, metrics.read_text().splitlines())
              if "loss" in r]
    return losses, folder / name / "checkpoints", result.stdout


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    return short_run(tmp_path_factory.mktemp("one"), "one", ["-n", "1"])


@pytest.mark.parametrize("layout, banner", [
    (["--set", "parallel.tp=2"], "tensor parallel over 2 x data parallel over 2"),
    (["--set", "parallel.pp=2", "--set", "parallel.microbatches=2"],
     "pipeline of 2 stages (1f1b, 2 micro-batches) x data parallel over 2"),
])
def test_model_parallel_run_equals_one_process(tmp_path: Path, layout: list[str], banner: str,
                                               one_process_run: tuple) -> None:
    """tp = 2 or pp = 2 on 4 ranks (dp = 2 outside): the same losses and final weights as
    one process on the global batch. Tensor parallelism gathers the whole model and
    optimizer state into its checkpoint; a pipeline's ranks write their own pieces."""
    runs = {"one": one_process_run, "four": short_run(tmp_path, "four", ["-n", "4", *layout])}
    assert banner in runs["four"][2]
    torch.testing.assert_close(runs["four"][0], runs["one"][0], rtol=1e-5, atol=1e-6)
    one = checkpoint.load(runs["one"][1])
    if "tp" in layout[1]:
        four = checkpoint.load(runs["four"][1])
        torch.testing.assert_close(four["optimizer"]["state"], one["optimizer"]["state"])
        weights = four["model"]
    else:
        weights = {k: v for shard in checkpoint.load_shards(runs["four"][1])
                   for k, v in shard["pipeline"]["model"].items()}
        assert set(weights) == set(one["model"])
    torch.testing.assert_close(weights, one["model"])


def test_parameter_server_run_equals_one_process(tmp_path: Path) -> None:
    """mode = "ps", sync: two workers and two servers holding AdamW's state reach the
    weights of one process on the global batch (the lr schedule travels with each push).
    Weight decay and clipping are off: the servers decay every element, and each worker
    clips its own gradient, where one process decays matrices only and clips the mean."""
    plain = ["--set", "optimizer.weight_decay=0", "--set", "optimizer.grad_clip=0"]
    one = short_run(tmp_path, "one", ["-n", "1", *plain])
    two = short_run(tmp_path, "ps", ["-n", "2", *plain, "--set", "parallel.mode='ps'",
                                     "--set", "parallel.servers=2", "--set",
                                     "parallel.snapshot_every=4"])
    assert "sync parameter-server training with 2 server(s) per machine" in two[2]
    torch.testing.assert_close(checkpoint.load(two[1])["model"], checkpoint.load(one[1])["model"],
                               rtol=1e-4, atol=1e-5)
    snapshots = [checkpoint.load(tmp_path / "ps" / "ps-snapshots" / f"server-{i}")
                 for i in range(2)]
    assert [s["updates"] for s in snapshots] == [4, 4]  # six updates, the last at four


@pytest.mark.parametrize("args, message, code", [
    (["--set", "train.stepz=3"], "did you mean 'train.steps'", 2),
    (["--set", "train.batch_size=15"], "make it a multiple of 2", 2),
    (["--set", "parallel.dp=3"], "make the product equal 2", 2),
    (["--set", "parallel.zero=4"], "must be one of 0, 1, 2, 3", 2),
    (["--set", "parallel.mixed_precision='bf16'"], "needs parallel.zero", 2),
    (["--set", "parallel.tp=3"], "parallel.tp = 3 does not divide model.n_head = 4", 2),
    (["--set", "parallel.tp=4"], "does not divide the world size 2", 2),
    (["--set", "parallel.tp=2", "--set", "parallel.zero=2"], "not supported yet", 2),
    (["--set", "parallel.mode='ps'", "--set", "parallel.tp=2"], "leave parallel.tp, pp", 2),
    (["--set", "parallel.consistency='eventual'"], "must be one of sync, async, ssp", 2),
    (["--set", "parallel.pp=8"], "= 8 stages but the model has 4 layers", 2),
    (["--set", "parallel.pp=2", "--set", "model.n_layer=2", "--set",
      "parallel.schedule='interleaved'"], "needs at least 2 chunks", 2),
    (["--set", "parallel.pp=2", "--set", "model.n_layer=2", "--set", "parallel.microbatches=3"],
     "2 ranks x 3 micro-batches: make it a multiple of 6", 2),
    (["--set", "data.path='/nonexistent/corpus'", "-n", "1"], "does not exist", 2),
    (["/nonexistent/config.toml"], "not found", 2),
])
def test_bad_input_is_one_line(args: list[str], message: str, code: int) -> None:
    result = dtrain("train", *args)
    assert result.returncode == code
    assert message in one_error_line(result)


def test_malformed_toml_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[train\nsteps = 3")
    result = dtrain("train", str(config))
    assert result.returncode == 2
    assert "not valid TOML" in one_error_line(result)


def test_binary_corpus_is_refused(tmp_path: Path) -> None:
    corpus = tmp_path / "data.bin"
    corpus.write_bytes(bytes(range(256)) * 10)
    result = dtrain("train", "-n", "1", "--set", f"data.path='{corpus}'")
    assert result.returncode == 2
    assert "looks binary" in one_error_line(result)
