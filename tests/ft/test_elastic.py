"""Elastic jobs (`dtrain train --nnodes MIN:MAX`): nodes that leave and join.

Three launchers on this machine stand for three machines, meeting at a store on loopback:
node A (2 ranks, hosts the store) and node B (2 ranks) start together: 4 ranks, tp=2 x dp=2.
After the checkpoint of step 2, B dies for good (SIGKILL of every process it started): A
goes on alone in a new round (2 ranks: tp=2, accumulating 3 batches) from that checkpoint.
After the checkpoint of step 4, node C (1 rank) arrives: A restarts its ranks for a new
round with C (3 ranks, which tp=2 does not divide: the planner's layout), from the newest
checkpoint, to the end. Each step's loss and the final weights equal one process's on the
same global batches.

The drills hold a rank still (SIGSTOP, dtrain.faults) as a step begins, so that the test
acts at a known step; the stall detector is told to leave held ranks alone. Slow (about a
minute).
"""

from __future__ import annotations

import json
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dtrain.checkpoint import atomic
from dtrain.config import dims_of, load_config
from dtrain.errors import ConfigError
from dtrain.ft import elastic
from tests.models.test_models_train import weights
from tests.support import forked
from tests.support.cli import TINY_MODEL, dtrain, free_port
from tests.support.poll import until

CONFIG = TINY_MODEL + """
[data]
max_bytes = 200000

[train]
steps = 8
batch_size = 12
eval_every = 0
eval_batches = 2

[checkpoint]
every = 2
background = false  # published before the next step begins, where the drills hold

[logging]
log_every = 1
sample_tokens = 0
"""


def start(folder: Path, name: str, nproc: int, port: int, *flags: str,
          fault: str = "") -> forked.Launched:
    """`dtrain train --nnodes 1:3` of `nproc` ranks with tp=2, output into
    `folder/name.out`: a launcher of its own, in a session of its own, forked so that it
    starts in milliseconds (node B must join node A's first round within its last call)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DTRAIN_TIMEOUT": "30",
           "DTRAIN_STALL_TIMEOUT": "0"}
    if fault:
        env["DTRAIN_FAULT"] = fault
    command = ["train", str(folder / "job.toml"),
               "-n", str(nproc), "--nnodes", "1:3", "--master", f"127.0.0.1:{port}",
               "--join-timeout", "60", "--set", f"train.out_dir='{folder / 'run'}'",
               "--set", "parallel.tp=2",
               "--metrics", str(folder / "metrics.jsonl"), *flags]
    return forked.start(command, env=env, out=folder / f"{name}.out", cwd=folder)


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def outputs(folder: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')}"
                     for p in sorted(folder.glob("*.out")))


@pytest.fixture
def launchers() -> Iterator[list[forked.Launched]]:
    """The launchers a test started: any still running at its end (it failed) are killed
    with their ranks."""
    started: list[forked.Launched] = []
    yield started
    for launcher in started:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)  # its ranks die with it
            launcher.wait(timeout=30)


def checkpointed(folder: Path, step: int):
    return lambda: any(e["step"] == step for e in atomic.read_index(folder / "run" / "checkpoints"))


def last_losses(metrics: Path) -> list[float]:
    """The loss of each step as last recorded (a round resumed re-runs a few steps)."""
    by_step = {}
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            by_step[record["step"]] = record["loss"]
    return [by_step[s] for s in sorted(by_step)]


@pytest.mark.parametrize("sets, world, most, want, note", [
    ([], 4, 4, (1, 1, 1), ""),
    ([], 2, 6, (1, 1, 3), "elastic: 2 of up to 6 ranks; gradient accumulation 3 keeps the "
                          "global batch of 12"),
    (["parallel.tp=2"], 4, 6, (2, 1, 2), "elastic: 4 of up to 6 ranks; gradient "
                                         "accumulation 2 keeps the global batch of 12"),
    (["parallel.tp=2"], 3, 6, (1, 1, 1), "elastic: 3 of up to 6 ranks; tp=2 x pp=1 does not "
                                         "divide it: dropped; gradient accumulation 1 keeps "
                                         "the global batch of 12"),
])
def test_a_round_keeps_the_global_batch_and_no_forward_grows(
        sets: list[str], world: int, most: int, want: tuple, note: str) -> None:
    config = load_config(None, ["train.batch_size=12", *sets])
    changed, said = elastic.adapt(config, world, most)
    assert (changed.parallel.tp, changed.parallel.pp, changed.train.grad_accum) == want
    assert said == note
    layout = dims_of(changed, world)
    tp_pp = config.parallel.tp * config.parallel.pp
    largest = 12 // (most // tp_pp)  # sequences per forward with every rank there
    assert 12 // (layout.dp * changed.train.grad_accum) <= largest


def test_a_round_tp_does_not_divide_takes_the_planners_best_layout() -> None:
    """tp=2 on 3 ranks: the planner's fastest layout that fits, with its options, in a
    config that validates, and said in the banner's note."""
    config = load_config(None, ["train.batch_size=12", "parallel.tp=2", "model.n_layer=3"])
    asked = []

    def choose(cfg, world_size, accum):
        asked.append((world_size, accum))
        return elastic.planned(cfg, world_size, accum)

    changed, said = elastic.adapt(config, 3, 4, choose)
    assert asked == [(3, 1)]
    p = changed.parallel
    layout = dims_of(changed, 3)
    assert layout.dp * layout.tp * layout.pp == 3 and p.tp == 1  # 4 heads: no tp=3
    assert said.startswith("elastic: 3 of up to 4 ranks; tp=2 x pp=1 does not divide it: "
                           f"the planner's best is dp={layout.dp}, tp=1, pp={layout.pp}"), said
    assert said.endswith("keeps the global batch of 12"), said
    # a layout the planner cannot fit: data parallel over every rank, as without a chooser
    fallback, note = elastic.adapt(config, 3, 4, lambda *_: None)
    assert dims_of(fallback, 3).dp == 3 and "dropped" in note


def test_a_batch_that_cannot_be_cut_for_a_round_is_one_line() -> None:
    config = load_config(None, ["train.batch_size=16"])
    with pytest.raises(ConfigError, match="cannot be cut evenly for 3 ranks"):
        elastic.adapt(config, 3, 4)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_an_elastic_job_goes_from_4_to_2_to_3_ranks_as_one_process_would(
        tmp_path: Path, launchers: list[forked.Launched]) -> None:
    (tmp_path / "job.toml").write_text(CONFIG)
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "job.toml").write_text(CONFIG)
    one = dtrain("train", str(alone / "job.toml"), "-n", "1",
                 "--set", f"train.out_dir='{alone / 'run'}'",
                 "--metrics", str(alone / "metrics.jsonl"), timeout=170)
    assert one.returncode == 0, one.stdout + one.stderr

    port = free_port()
    # A hosts the store (node 0). B's first rank (rank 2) holds as step 3 begins in the
    # first round; A's first rank as step 5 begins in the second.
    a = start(tmp_path, "a", 2, port, "--node-rank", "0", fault="stop@step=5,rank=0,attempt=1")
    launchers.append(a)
    until(lambda: listening(port), 60, "node A's store", running=[a.poll],
          describe=lambda: outputs(tmp_path), every=0.2)
    b = start(tmp_path, "b", 2, port, fault="stop@step=3,rank=2")
    launchers.append(b)
    procs = [a, b]
    until(checkpointed(tmp_path, 2), 120, "the checkpoint of step 2",
          running=[p.poll for p in procs], describe=lambda: outputs(tmp_path), every=0.2)
    os.killpg(b.pid, signal.SIGKILL)  # node B dies (its ranks die with their agent)
    b.wait(timeout=30)
    procs = [a]
    until(checkpointed(tmp_path, 4), 120, "the checkpoint of step 4 by A alone",
          running=[p.poll for p in procs], describe=lambda: outputs(tmp_path), every=0.2)
    c = start(tmp_path, "c", 1, port)
    launchers.append(c)
    procs = [a, c]
    assert a.wait(timeout=240) == 0, outputs(tmp_path)
    assert c.wait(timeout=60) == 0, outputs(tmp_path)

    text = (tmp_path / "a.out").read_text()
    assert "4 rank(s), tensor parallel over 2 x data parallel over 2" in text, outputs(tmp_path)
    assert "lost node 1 (ranks 2-3)" in text and "going on without it" in text, text
    assert "2 rank(s), tensor parallel over 2 x data parallel over 1" in text, text
    assert "elastic: 2 of up to 6 ranks; gradient accumulation 3" in text, text
    assert ("elastic: 3 of up to 6 ranks; tp=2 x pp=1 does not divide it: the planner's "
            "best is dp=3") in text, text
    checkpoints = tmp_path / "run" / "checkpoints"
    assert f"resumed from {checkpoints / 'step-00000002'} (step 2)" in text, text
    assert f"resumed from {checkpoints / 'step-00000004'} (step 4)" in text, text
    got, want = last_losses(tmp_path / "metrics.jsonl"), last_losses(alone / "metrics.jsonl")
    assert len(got) == len(want) == 8
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights(checkpoints), weights(alone / "run" / "checkpoints"),
                               rtol=1e-4, atol=5e-5)
