"""What a run shows of itself: MFU and hardware use (dtrain.train.speed, .hardware) and the
metrics sinks (dtrain.train.sinks: JSON lines, TensorBoard, Weights & Biases)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import dtrain
from dtrain import models
from dtrain.config import Config, LoggingConfig
from dtrain.errors import ConfigError, exit_code_of
from dtrain.models.config import ModelConfig
from dtrain.planner.shape import ModelShape
from dtrain.testing import run_ranks
from dtrain.train import hardware, sinks, speed
from dtrain.train.check import check_job
from tests.support.cli import TINY_MODEL, train_rows
from tests.support.poll import until

WANDB_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
             "WANDB_DISABLE_CODE": "true"}
"""W&B in the tests: never the network, nothing printed, nothing read from git."""


@pytest.fixture
def wandb_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """W&B's own folders (config, cache, data) in tmp_path, offline: the environment."""
    env = {**WANDB_ENV, **{f"WANDB_{name}_DIR": str(tmp_path / f"wandb-{name.lower()}")
                           for name in ("CONFIG", "CACHE", "DATA")}}
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def test_mfu_is_flops_times_tokens_over_ranks_and_peak() -> None:
    flops, tokens_per_s, ranks, peak = 3.0e9, 2.0e5, 4, 300.0
    assert speed.achieved_tflops(flops, tokens_per_s, ranks) == flops * tokens_per_s / 4 / 1e12
    assert speed.mfu(flops, tokens_per_s, ranks, peak) == \
        flops * tokens_per_s / ranks / 1e12 / peak == pytest.approx(0.5)


def test_model_flops_are_the_planners() -> None:
    """GPT and Llama: the planner's 6N + 12·l·h·s; a custom model: 6 x its parameters."""
    for arch in ("gpt", "llama"):
        shape = models.resolve(ModelConfig(arch=arch, n_layer=2, n_head=4, n_embd=64,
                                           block_size=128), 256)
        flops = speed.flops_per_token(shape, n_params=123)
        assert flops.per_token == ModelShape.of(shape).model_flops_per_token()
        assert flops.source == "6N + 12·l·h·s"
    custom = speed.flops_per_token(ModelConfig(arch="custom"), n_params=1000)
    assert (custom.per_token, custom.source) == (6000.0, "6 x parameters")


def test_gpu_peaks_by_device_name() -> None:
    assert hardware.gpu_peak("NVIDIA H100 80GB HBM3") == 989
    assert hardware.gpu_peak("NVIDIA H100 PCIe") == 756
    assert hardware.gpu_peak("NVIDIA H200") == 989
    assert hardware.gpu_peak("NVIDIA A100-SXM4-80GB") == 312
    assert hardware.gpu_peak("NVIDIA L4") == 121
    assert hardware.gpu_peak("NVIDIA L40S") == 362
    assert hardware.gpu_peak("Some Future GPU") == 0.0
    configured = hardware.peak_of(123.0, torch.device("cpu"))
    assert (configured.tflops, configured.source) == (123.0, "[logging] peak_tflops")


def test_cpu_peak_is_calibrated_once_then_cached(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured = hardware.calibrate(size=256, repeats=2)
    assert measured > 0
    calls = []
    monkeypatch.setattr(hardware, "calibrate", lambda: calls.append(1) or 0.25)
    assert hardware.cpu_peak() == 0.25 and hardware.cpu_peak() == 0.25
    assert len(calls) == 1
    cached = json.loads((tmp_path / "dtrain" / "cpu_peak.json").read_text())
    assert cached == {f"{hardware.cpu_name()} | {torch.get_num_threads()} threads": 0.25}
    assert hardware.peak_of(0.0, torch.device("cpu")).tflops == 0.25


def test_peak_memory_is_the_process_peak() -> None:
    assert hardware.peak_memory_bytes(torch.device("cpu")) > 50 * 2**20  # torch alone


def test_the_slowest_rank_against_the_median() -> None:
    worst = speed.slowest([1.0, 1.0, 1.5, 1.0])
    assert (worst.rank, worst.seconds, worst.ratio) == (2, 1.5, 1.5)
    assert worst.line() == "straggler: rank 2 took 1.5 s, 1.5x the median"


def test_one_rank_figures_and_a_straggler_line_at_most_every_log_every() -> None:
    step_speed = speed.StepSpeed(speed.ModelFlops(1e6, "test"), hardware.Peak(1.0, "test"),
                                 ranks=1, device=torch.device("cpu"), group=None,
                                 gather=False, every=2)
    figures, line = step_speed.measure(1, 0.5, 1000.0)
    assert figures["tflops"] == 1e6 * 1000 / 1e12 and figures["mfu"] == figures["tflops"]
    assert figures["peak_memory_gib"] > 0 and figures["slowest_rank"] == 0
    assert line == ""  # one rank is its own median
    unknown = speed.StepSpeed(speed.ModelFlops(1e6, "test"), hardware.Peak(0.0, "none"),
                              ranks=1, device=torch.device("cpu"), group=None, gather=False,
                              every=2)
    assert "mfu" not in unknown.measure(1, 0.5, 1000.0)[0]


def _two_ranks_one_slow(every: int) -> list[str]:
    """Two ranks measure 4 steps; rank 1 is busy three times as long as rank 0 (its step
    time is what it computed: it waited in no collective)."""
    rank = dtrain.world.current().rank
    step_speed = speed.StepSpeed(speed.ModelFlops(1e6, "test"), hardware.Peak(1.0, "test"),
                                 ranks=2, device=torch.device("cpu"), group=None,
                                 gather=True, every=every)
    lines = []
    for step in range(1, 5):
        step_speed.begin()
        figures, line = step_speed.measure(step, 0.3 if rank == 1 else 0.1, 1000.0)
        assert figures["slowest_rank"] == 1 and figures["slowest_busy_s"] == 0.3
        lines.append(line)
    return lines


def test_a_slow_rank_of_two_is_named_every_log_every_steps() -> None:
    """Two ranks, one busy 3x as long: its busy time reaches every rank in the step's
    all-gather, and every `every` steps (not more often) a line names it."""
    for lines in run_ranks(_two_ranks_one_slow, 2, 2):
        assert lines == ["", "straggler: rank 1 took 0.3 s, 1.5x the median"] * 2, lines


def test_scalars_are_tagged_by_group() -> None:
    values = {"time": 1.0, "loss": 2.5, "mfu": 0.4, "eval_loss": 3.0,
              "moe_imbalance": [1.5, 1.25], "peak_memory_gib": 1.0, "live_replicas": 2}
    assert sinks.scalars(values) == {
        "train/loss": 2.5, "speed/mfu": 0.4, "eval/eval_loss": 3.0,
        "moe/moe_imbalance/0": 1.5, "moe/moe_imbalance/1": 1.25,
        "memory/peak_memory_gib": 1.0, "train/live_replicas": 2.0}


def _tensorboard_scalars(folder: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


def test_tensorboard_sink_reads_back(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    sink = sinks.TensorBoard(tmp_path / "tb")
    losses = {1: 4.25, 2: 3.5, 3: 3.125}
    for step, loss in losses.items():
        sink.record(step, {"time": 0.0, "loss": loss, "moe_imbalance": [1.5]})
    sink.close()
    assert _tensorboard_scalars(tmp_path / "tb", "train/loss") == losses
    assert _tensorboard_scalars(tmp_path / "tb", "moe/moe_imbalance/0") == {1: 1.5, 2: 1.5,
                                                                            3: 1.5}


def test_missing_dependency_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """As if tensorboard (or wandb) were not installed: `dtrain train` stops at its checks
    with one line naming the extra, exit code 2."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    config = Config()
    config.logging.tensorboard = True
    assert exit_code_of(lambda: check_job(config)) == 2
    err = capsys.readouterr().err
    assert err == ("dtrain: error: [logging] tensorboard = true needs the tensorboard "
                   "package: pip install 'dtrain[tensorboard]'\n")
    with pytest.raises(ConfigError, match=r"pip install 'dtrain\[wandb\]'"):
        sinks.check_dependencies(LoggingConfig(wandb="offline"))
    sinks.check_dependencies(LoggingConfig())  # neither asked for: nothing needed


def test_online_without_a_key_falls_back_to_offline(tmp_path: Path, wandb_home: dict,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    netrc = tmp_path / "netrc"
    netrc.write_text("")
    monkeypatch.setenv("NETRC", str(netrc))
    said: list[str] = []
    assert sinks.wandb_mode(LoggingConfig(wandb="online"), said.append) == "offline"
    assert len(said) == 1 and "logging offline instead" in said[0]
    netrc.write_text("machine api.wandb.ai login user password k3y\n")
    netrc.chmod(0o600)
    assert sinks.wandb_mode(LoggingConfig(wandb="online"), said.append) == "online"
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.setenv("WANDB_API_KEY", "k3y")
    assert sinks.wandb_mode(LoggingConfig(wandb="online"), said.append) == "online"
    assert sinks.wandb_mode(LoggingConfig(wandb="offline"), said.append) == "offline"
    assert len(said) == 1


# Reading an offline W&B run back. Its `.wandb` file is a LevelDB log (blocks of 32 KiB,
# chunks of a 7-byte header: crc32, length, type) of wandb_internal_pb2.Record protobufs,
# after a 7-byte file header; wandb has no public reader of offline runs.
BLOCK, CHUNK_HEADER, FULL, LAST = 32768, 7, 1, 4


def _wandb_records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, found, pending = 7, [], b""
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # a block's tail too short for a chunk is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + CHUNK_HEADER:pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind in (FULL, LAST):
            found.append(pending)
            pending = b""
    return found


def wandb_history(folder: Path) -> list[dict[str, object]]:
    """The rows `wandb.log` wrote in the offline run under `folder` (wandb.init's dir), as
    far as its service process has written them: none while the run file does not exist
    yet, and a record still being written (its chunks or bytes not all there) is not one
    yet. Poll it (tests.support.poll) to wait for rows."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    paths = list(folder.glob("wandb/offline-run-*/run-*.wandb"))
    if not paths or paths[0].stat().st_size < 7:
        return []
    (path,) = paths
    rows = []
    for raw in _wandb_records(path):
        record = wandb_internal_pb2.Record()
        try:
            record.ParseFromString(raw)
        except DecodeError:  # the last record, half written
            break
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def test_wandb_offline_sink_reads_back(tmp_path: Path, wandb_home: dict) -> None:
    pytest.importorskip("wandb")
    said: list[str] = []
    sink = sinks.WandB(tmp_path / "wandb", "offline", "dtrain-tests", {"train": {"steps": 3}},
                       said.append)
    losses = {1: 4.25, 2: 3.5, 3: 3.125}
    for step, loss in losses.items():
        sink.record(step, {"time": 0.0, "loss": loss, "mfu": 0.5})
    sink.close()
    assert len(said) == 1 and "wandb sync" in said[0]
    # wandb's service process may finish writing the run file just after finish() returns
    until(lambda: len(wandb_history(tmp_path / "wandb")) >= len(losses), 30,
          "every step in W&B's run file")
    rows = wandb_history(tmp_path / "wandb")
    assert {r["_step"]: r["train/loss"] for r in rows} == losses
    assert all(r["speed/mfu"] == 0.5 for r in rows)


PEAK = 2.0  # TFLOP/s, so that the run's MFU is known exactly


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_reports_mfu_and_writes_tensorboard_and_wandb(tmp_path: Path,
                                                            wandb_home: dict) -> None:
    """Two ranks, 6 steps: each JSONL record's MFU is the planner's FLOPs per token x
    tokens/s / ranks / peak_tflops; TensorBoard and W&B hold the same losses."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    config = TINY_MODEL + f"""
[data]
max_bytes = 100000

[logging]
log_every = 2
sample_tokens = 0
tensorboard = true
wandb = "offline"
wandb_project = "dtrain-tests"
peak_tflops = {PEAK}
"""
    rows, _ = train_rows(tmp_path, config, [], steps=6)
    assert [r["step"] for r in rows] == list(range(1, 7))
    vocab = 256  # the default data: bytes
    shape = models.resolve(ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=32), vocab)
    flops = ModelShape.of(shape).model_flops_per_token()
    for r in rows:
        assert r["tflops"] == pytest.approx(flops * r["tokens_per_s"] / 2 / 1e12, rel=1e-12)
        assert r["mfu"] == pytest.approx(flops * r["tokens_per_s"] / 2 / 1e12 / PEAK,
                                         rel=1e-12)
        assert r["peak_memory_gib"] > 0 and r["slowest_rank"] in (0, 1)
        assert r["slowest_vs_median"] >= 1.0 and "grad_norm" in r
    losses = {r["step"]: r["loss"] for r in rows}
    tensorboard = _tensorboard_scalars(tmp_path / "run" / "tensorboard", "train/loss")
    assert tensorboard == {s: float(torch.tensor(v, dtype=torch.float32))
                           for s, v in losses.items()}  # TensorBoard keeps float32
    # wandb's service process may finish writing the run file after the run has ended
    until(lambda: len([r for r in wandb_history(tmp_path / "run" / "wandb")
                       if "train/loss" in r]) >= len(losses), 30, "every step in W&B's run file")
    history = wandb_history(tmp_path / "run" / "wandb")
    assert {r["_step"]: r["train/loss"] for r in history if "train/loss" in r} == losses
