"""Running the `dtrain` command as a user would, in a process of its own."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from dtrain.testing import fork_server
from tests.support import forked
from tests.support.forked import run_cli

TINY_MODEL = """
[model]
n_layer = 1
n_head = 2
n_embd = 32
block_size = 32
"""
"""The smallest GPT of the command-line tests' configs (a few seconds a run)."""

EXACT_OPTIMIZER = """
[optimizer]
name = "sgd"
momentum = 0.9
weight_decay = 0.0
grad_clip = 0.0
"""
"""The optimizer of runs compared with one process: plain SGD with momentum and no clip,
whose update is proportional to the gradient, so that a gradient averaged with a wrong
divisor shows in the losses and weights (Adam's update is blind to a gradient's scale,
and clipping turns a global scale into a uniform one). The per-step `grad_norm`, before
any clip, is compared too."""


def exact_run(out: Path, steps: int, batch: int, parallel: dict) -> dict:
    """The sections of a short run (as `config_from_dict` takes them) compared with one
    process: EXACT_OPTIMIZER's SGD at a constant rate, `steps` steps of `batch` sequences,
    one held-out batch at the end, metrics in `out/metrics.jsonl`, no sample, blocking
    saves, the layout `parallel`."""
    return {"optimizer": {"name": "sgd", "lr": 0.5, "momentum": 0.9, "weight_decay": 0.0,
                          "grad_clip": 0.0, "warmup_steps": 0, "schedule": "constant"},
            "train": {"steps": steps, "batch_size": batch, "eval_every": 0,
                      "eval_batches": 1, "out_dir": str(out)},
            "logging": {"sample_tokens": 0, "metrics": str(out / "metrics.jsonl")},
            "checkpoint": {"background": False}, "parallel": parallel}


def dtrain(*args: str, timeout: float = 120, cwd: str | None = None,
           env: dict[str, str] | None = None,
           preexec: Callable[[], None] | None = None) -> subprocess.CompletedProcess:
    """Run `dtrain ARGS` in a process of its own (extra `env`; `preexec` runs in the child
    before it starts), as `python -m dtrain.cli ARGS` would.

    The process is forked from the tests' fork server (dtrain.testing.processes), where torch and
    dtrain are imported already: the command starts in milliseconds instead of the seconds
    of an import, and behaves the same (its own process, environment, working folder,
    standard streams and exit code; the ranks it launches are new processes as always).
    With `preexec` it is a plain subprocess. Raises subprocess.TimeoutExpired after
    `timeout` seconds, the process killed, as subprocess.run does."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    command = [sys.executable, "-m", "dtrain.cli", *args]
    if preexec is not None:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=env, cwd=cwd, preexec_fn=preexec)
    with tempfile.TemporaryDirectory(prefix="dtrain-cli-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        proc = fork_server().Process(target=run_cli,
                                     args=(list(args), env, cwd, str(out), str(err)))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(command, timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(command, proc.exitcode, out.read_text(),
                                           err.read_text())


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The single `dtrain: error:` line of stderr; fails if there is a traceback."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("dtrain: error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def assert_refused(folder: Path, config_text: str, overrides: list[str], message: str,
                   nproc: int = 2) -> None:
    """`dtrain train` of `config_text` with `--set overrides` exits 2 with one error line
    holding `message`, and writes nothing (no folder/run)."""
    config = folder / "refused.toml"
    config.write_text(config_text)
    sets = [arg for o in overrides for arg in ("--set", o)]
    result = dtrain("train", str(config), "-n", str(nproc), *sets,
                    "--set", f"train.out_dir='{folder / 'run'}'")
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in one_error_line(result)
    assert not (folder / "run").exists()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def assert_same_steps(got: list[dict], want: list[dict]) -> None:
    """Two runs' metrics rows step for step: the same loss and gradient norm (before any
    clip), each within float32 rounding of a sum taken in another order."""
    import torch

    assert [r["step"] for r in got] == [r["step"] for r in want]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close([r[key] for r in got], [r[key] for r in want], rtol=1e-5,
                                   atol=1e-6, msg=lambda m, key=key: f"{key} per step: {m}")


def train_rows(folder: Path, config_text: str, args: list[str], steps: int
               ) -> tuple[list[dict], Path]:
    """`dtrain train` of `config_text` (written into `folder`) with `args` for `steps`
    steps, its output in folder/run: the metrics rows that carry a loss, and the
    checkpoints folder. Each call in the same folder keeps its own metrics file (a run
    resumed there adds to the same checkpoints)."""
    folder.mkdir(exist_ok=True)
    config = folder / "config.toml"
    config.write_text(config_text)
    metrics = folder / f"metrics-{len(list(folder.glob('metrics-*')))}.jsonl"
    result = dtrain("train", str(config), *args, "--set", f"train.steps={steps}",
                    "--set", f"train.out_dir='{folder / 'run'}'", "--metrics", str(metrics),
                    timeout=170)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r for r in rows if "loss" in r], folder / "run" / "checkpoints"


def _train_each(runs: list[tuple[str, list[str], str]]) -> None:
    """On each rank: every run (config file, --set overrides, metrics file) trained in
    turn by dtrain train's Trainer on this process's world."""
    from dtrain.config import load_config
    from dtrain.train.trainer import Trainer

    for config, overrides, metrics in runs:
        Trainer(load_config(config, overrides), metrics).run()


def train_rows_together(runs: list[tuple[Path, str, list[str], int]], nproc: int
                        ) -> list[tuple[list[dict], Path]]:
    """`train_rows` of several runs on `nproc` ranks, trained in turn by dtrain train's
    Trainer on one set of ranks forked once (`dtrain.testing.run_ranks`) instead of a
    launch each: the same loop, config and metrics, without the launcher's start-up.
    Each run is (folder, config text, --set overrides, steps); a launcher flag (-n,
    --resume, --timeline) is not taken."""
    from dtrain.testing import run_ranks

    planned = []
    for folder, config_text, overrides, steps in runs:
        folder.mkdir(exist_ok=True)
        config = folder / "config.toml"
        config.write_text(config_text)
        metrics = folder / f"metrics-{len(list(folder.glob('metrics-*')))}.jsonl"
        planned.append((str(config), [*overrides, f"train.steps={steps}",
                                      f"train.out_dir='{folder / 'run'}'",
                                      f"parallel.nproc={nproc}"], str(metrics)))
    run_ranks(_train_each, nproc, planned, timeout=170 * len(runs))
    out = []
    for (folder, *_), (_, _, metrics) in zip(runs, planned, strict=True):
        rows = [json.loads(line) for line in Path(metrics).read_text().splitlines()]
        out.append(([r for r in rows if "loss" in r], folder / "run" / "checkpoints"))
    return out


def train_apart(folder: Path, config_text: str, steps: int, *flags: str,
                env: dict[str, str] | None = None) -> str:
    """`dtrain train` of `config_text` as two machines on loopback (node 0 holds the
    store), `-n 1` each, each machine's out_dir its own (folder/A/run, folder/B/run), with
    `flags` and the extra `env`; both must end well. Returns their output (folder/A.out,
    folder/B.out)."""
    (folder / "job.toml").write_text(config_text)
    port, launched = free_port(), []
    for node, host in enumerate("AB"):
        (folder / host).mkdir(exist_ok=True)
        launched.append(forked.start(
            ["train", str(folder / "job.toml"), "-n", "1", "--nnodes", "2", "--node-rank",
             str(node), "--master", f"127.0.0.1:{port}", "--set", f"train.steps={steps}",
             "--set", f"train.out_dir='{folder / host / 'run'}'", *flags],
            env={**os.environ, "OMP_NUM_THREADS": "1", "DTRAIN_TIMEOUT": "30", **(env or {})},
            out=folder / f"{host}.out", cwd=folder / host))
    return forked.wait_all(launched, 150, [folder / f"{h}.out" for h in "AB"])
