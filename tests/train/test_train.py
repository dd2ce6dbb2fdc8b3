"""`dtrain train` end to end on a tiny config, and its answers to bad input."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dtrain.checkpoint import atomic, universal
from dtrain.data import batches, open_data
from dtrain.models.gpt import GPT, GPTConfig
from tests.support.cli import TINY_MODEL, dtrain, one_error_line, train_rows_together

TINY = TINY_MODEL + """
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
    saved = universal.Checkpoint(tmp_path / "run" / "checkpoints")
    assert saved.step == 40 and "model/wte.weight" in saved
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["steps"] == 40
    assert "sample:" in result.stdout and "step    40/40" in result.stdout
    assert "[rank1]" not in result.stdout  # rank 1 trains silently


@pytest.mark.slow
def test_zero_stage_3_run_learns_and_writes_shards(tmp_path: Path) -> None:
    """[parallel] zero = 3 in bf16 with two micro-batches: the loss falls, and every rank
    writes its own shard of the model into the checkpoint."""
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.replace("steps = 40", "steps = 20").replace("eval_every = 20",
                                                                        "eval_every = 0"))
    metrics = tmp_path / "metrics.jsonl"
    result = dtrain("train", str(config), "--set", f"train.out_dir='{tmp_path / 'run'}'",
                    "--set", "parallel.zero=3", "--set", "parallel.mixed_precision='bf16'",
                    "--set", "train.grad_accum=2", "--metrics", str(metrics), timeout=170)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ZeRO stage 3 over 2" in result.stdout
    assert "sample (in split form: dp2 zero3):" in result.stdout
    losses = [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3
    ckpt = universal.Checkpoint(tmp_path / "run" / "checkpoints")
    assert ckpt.step == 20 and ckpt.meta["layout"]["zero"] == 3
    files = {p["file"] for entry in ckpt.tensors.values() for p in entry["pieces"]}
    assert files == {"rank-00000.safetensors", "rank-00001.safetensors"}


def short_run(folder: Path, name: str, args: list[str], steps: int = 6, **run: Any
              ) -> tuple[list[float], Path, str]:
    """`steps` steps of a two-layer TINY at a constant learning rate after warm-up (so a
    run of 3 steps, resumed up to 6, follows the 6-step run): (losses, checkpoints, stdout).
    `run`: more arguments for tests.support.cli.dtrain (env, preexec)."""
    result = short_run_result(folder, name, args, steps, **run)
    assert result.returncode == 0, result.stdout + result.stderr
    metrics = folder / f"{name}.jsonl"
    losses = [r["loss"] for r in map(json.loads, metrics.read_text().splitlines())
              if "loss" in r]
    return losses, folder / name / "checkpoints", result.stdout


def short_run_result(folder: Path, name: str, args: list[str], steps: int = 6,
                     **run: Any) -> subprocess.CompletedProcess:
    """The finished `dtrain train` process of short_run, whatever its exit code."""
    config = folder / "tiny.toml"
    config.write_text(TINY.replace("eval_every = 20", "eval_every = 0"))
    return dtrain("train", str(config), *args, "--set", f"train.steps={steps}",
                  "--set", "model.n_layer=2", "--set", "optimizer.schedule='constant'",
                  "--set", f"train.out_dir='{folder / name}'", "--set",
                  "logging.sample_tokens=0", "--metrics", str(folder / f"{name}.jsonl"),
                  timeout=170, **run)


def forked_run(folder: Path, name: str, args: list[str], steps: int = 6
               ) -> tuple[list[float], Path]:
    """short_run's run by the Trainer on ranks forked once (tests.support.cli.
    train_rows_together), without a launch: (losses, checkpoints). `args`: "-n N" and
    "--set KEY=VALUE" only (a reference run, whose output nothing reads)."""
    nproc, overrides = 1, []
    for flag, value in zip(args[::2], args[1::2], strict=True):
        if flag == "-n":
            nproc = int(value)
        else:
            assert flag == "--set", f"forked_run takes -n and --set, not {flag}"
            overrides.append(value)
    overrides += ["model.n_layer=2", "optimizer.schedule='constant'", "logging.sample_tokens=0"]
    ((rows, checkpoints),) = train_rows_together([(
        folder / name, TINY.replace("eval_every = 20", "eval_every = 0"), overrides, steps)],
        nproc)
    return [r["loss"] for r in rows], checkpoints


def model_of(checkpoints: Path) -> dict[str, torch.Tensor]:
    """The plain model's state_dict, as `dtrain export` writes it."""
    out = checkpoints.parent / "model.safetensors"
    return load_file(universal.export(checkpoints, out))


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], Path]:
    return forked_run(tmp_path_factory.mktemp("one"), "one", ["-n", "1"])


DP2_TP2 = ["-n", "4", "--set", "parallel.tp=2"]
PP2 = ["--set", "parallel.pp=2", "--set", "parallel.microbatches=2"]


@pytest.mark.parametrize("first, then, banner", [
    pytest.param(DP2_TP2, ["-n", "4"], "tensor parallel over 2 x data parallel over 2",
                 marks=pytest.mark.slow),
    pytest.param(["-n", "4", *PP2], ["-n", "4", *PP2, "--set", "parallel.zero=3"],
                 "pipeline of 2 stages (1f1b, 2 micro-batches) x data parallel over 2",
                 marks=pytest.mark.slow),
    pytest.param(["-n", "4", "--set", "parallel.tp=2", *PP2], ["-n", "1"],
                 "pipeline of 2 stages (1f1b, 2 micro-batches) x tensor parallel over 2 x "
                 "data parallel over 1", marks=pytest.mark.slow),
    pytest.param([*DP2_TP2, "--set", "parallel.zero=3"],
                 ["-n", "2", *PP2, "--set", "parallel.zero=1"],
                 "tensor parallel over 2 x ZeRO stage 3 over 2", marks=pytest.mark.slow),
    pytest.param(["-n", "8", "--set", "parallel.tp=2", *PP2, "--set", "parallel.zero=1"],
                 ["-n", "2", *PP2], "pipeline of 2 stages (1f1b, 2 micro-batches) x tensor "
                 "parallel over 2 x ZeRO stage 1 over 2", marks=pytest.mark.slow),
], ids=["dp2xtp2-to-dp4", "dp2xpp2-to-pp2xzero3", "tp2xpp2-to-one", "dp2xtp2xzero3-to-pp2xzero1",
        "dp2xtp2xpp2xzero1-to-pp2"])
def test_run_resumed_in_another_layout_equals_one_process(
        tmp_path: Path, first: list[str], then: list[str], banner: str,
        one_process_run: tuple) -> None:
    """Three steps in one layout on 4 (or 8) ranks, saved; resumed in another layout for three more:
    the losses of all six steps and the final weights are those of one process on the same
    global batches. The checkpoint holds each logical tensor in pieces written by the ranks
    that own them, and the second layout reads whatever it needs of them. (All run with
    make test-slow: 13-60 s each on 2 cores.)"""
    losses, saved, stdout = short_run(tmp_path, "first", first, steps=3)
    assert banner in stdout
    rest = short_run(tmp_path, "then", [*then, "--resume", str(saved)])
    assert f"resumed from {saved / 'step-00000003'} (step 3)" in rest[2]
    one = one_process_run
    torch.testing.assert_close(losses + rest[0], one[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model_of(rest[1]), model_of(one[1]), rtol=1e-4, atol=2e-5)


def test_resume_in_the_same_layout_continues_exactly(tmp_path: Path,
                                                     one_process_run: tuple) -> None:
    """`--resume` picks the run's newest checkpoint: model, AdamW state, schedule, data
    position and RNG come back, and the weights are those of the uninterrupted run."""
    short_run(tmp_path, "run", ["-n", "1"], steps=3)
    losses, checkpoints, stdout = short_run(tmp_path, "run", ["-n", "1", "--resume"])
    assert "resumed from" in stdout and len(losses) == 3
    torch.testing.assert_close(losses, one_process_run[0][3:], rtol=0, atol=0)
    torch.testing.assert_close(model_of(checkpoints), model_of(one_process_run[1]),
                               rtol=0, atol=0)


def test_export_loads_into_the_plain_model_with_the_same_eval_loss(
        tmp_path: Path, one_process_run: tuple) -> None:
    """`dtrain export` to .pt and .safetensors: a state_dict for the unparallelized GPT
    (tied head included) whose held-out loss is the run's final one."""
    folder = one_process_run[1]
    records = [json.loads(line) for line in (folder.parent.parent / "metrics-0.jsonl")
               .read_text().splitlines()]
    final = [r["eval_loss"] for r in records if "eval_loss" in r][-1]
    out = tmp_path / "model.pt"
    assert dtrain("export", str(folder), str(out)).returncode == 0
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32)
    for state in (torch.load(out, weights_only=True), model_of(folder)):
        gpt = GPT(config)
        gpt.load_state_dict(state)
        data = open_data("", "text", "bytes", 200_000, 0.05, 32).val
        stream = batches(data, 16, 1, 0, seed=0, shuffle=False)
        with torch.no_grad():
            loss = sum(gpt(x, y)[1].item() for _, (x, y) in zip(range(2), stream, strict=False))
            loss /= 2
        assert abs(loss - final) < 1e-5
    bad = dtrain("export", str(folder), str(tmp_path / "model.bin"))
    assert bad.returncode != 0 and ".safetensors or .pt" in one_error_line(bad)


def test_resume_into_another_model_is_one_line(one_process_run: tuple) -> None:
    result = dtrain("train", "-n", "1", "--set", "model.n_embd=64", "--resume",
                    str(one_process_run[1]))
    assert result.returncode == 2
    assert "holds another model (" in one_error_line(result)
    assert "model.n_embd = 32 there, 64 here" in one_error_line(result)


@pytest.mark.slow
def test_parameter_server_run_equals_one_process(tmp_path: Path) -> None:
    """mode = "ps", sync: two workers and two servers holding AdamW's state reach the
    weights of one process on the global batch (the lr schedule travels with each push).
    Weight decay and clipping are off: the servers decay every element, and each worker
    clips its own gradient, where one process decays matrices only and clips the mean."""
    plain = ["--set", "optimizer.weight_decay=0", "--set", "optimizer.grad_clip=0"]
    one = short_run(tmp_path, "one", ["-n", "1", *plain])
    two = short_run(tmp_path, "ps", ["-n", "2", *plain, "--set", "parallel.exchange='ps'",
                                     "--set", "ps.servers=2", "--set",
                                     "ps.snapshot_every=4"])
    assert "sync parameter-server training with 2 server(s) per machine" in two[2]
    torch.testing.assert_close(model_of(two[1]), model_of(one[1]), rtol=1e-4, atol=1e-5)
    snapshots = [atomic.load(tmp_path / "ps" / "ps-snapshots" / f"server-{i}")
                 for i in range(2)]
    assert [s["updates"] for s in snapshots] == [4, 4]  # six updates, the last at four
