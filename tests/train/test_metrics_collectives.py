"""The metrics cost one collective per `log_every` steps, not one or two a step: every rank
keeps its step's loss, busy time and peak memory, and they travel together in one
all-gather at the log step (and before an evaluation, a checkpoint and the end), while
the metrics file keeps one record per step, in step order, with the values a per-step
gather gives."""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dtrain import comm
from dtrain.comm.threads import ThreadGroup
from dtrain.testing import run_ranks, run_threads
from dtrain.train.hardware import Peak
from dtrain.train.speed import ModelFlops, StepSpeed
from dtrain.train.trainer import StepLoss
from tests.data_parallel.test_hsdp import CONFIG

STEPS = 20
"""Steps of each run: two logs of 10 (CONFIG: the tiny GPT, exact SGD, batch 8)."""
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "scatter",
               "gather", "all_to_all", "barrier")


def _counting(original: Callable[..., Any], seen: Counter[str]) -> Callable[..., Any]:
    """`original` (a dtrain.comm collective), counting each call over two or more ranks
    that a module of dtrain.train makes, by the calling function's name."""
    def call(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_code
        if "/dtrain/train/" in caller.co_filename and \
                comm.resolve(kwargs.get("group")).size > 1:
            seen[caller.co_name] += 1
        return original(*args, **kwargs)

    return call


def _counted_runs(runs: list[tuple[str, list[str], str]]) -> list[dict[str, int]]:
    """On each rank: each run (config file, --set overrides, metrics file) trained by the
    Trainer, with dtrain.train's collectives counted (`_counting`)."""
    from dtrain.config import load_config
    from dtrain.train.trainer import Trainer

    counts = []
    for config, overrides, metrics in runs:
        seen: Counter[str] = Counter()
        originals = {name: getattr(comm, name) for name in COLLECTIVES}
        for name, original in originals.items():
            setattr(comm, name, _counting(original, seen))
        try:
            Trainer(load_config(config, overrides), metrics).run()
        finally:
            for name, original in originals.items():
                setattr(comm, name, original)
        counts.append(dict(seen))
    return counts


@pytest.mark.timeout(240)
def test_one_metrics_collective_per_log_every_steps_and_the_same_records(
        tmp_path: Path) -> None:
    """Two ranks (dp=2), 20 steps: with log_every=10 the Trainer's own collectives are one
    all-gather at steps 10 and 20 (and the final evaluation's mean); with log_every=1, one
    a step. Both metrics files hold the same 20 records: the same keys, and the same loss,
    gradient norm, learning rate and bytes sent, bit for bit."""
    (tmp_path / "config.toml").write_text(CONFIG)
    runs = [(str(tmp_path / "config.toml"),
             [f"logging.log_every={every}", f"train.steps={STEPS}",
              f"train.out_dir='{tmp_path / f'run{every}'}'", "parallel.nproc=2"],
             str(tmp_path / f"metrics{every}.jsonl")) for every in (10, 1)]
    per_rank = run_ranks(_counted_runs, 2, runs, timeout=220)
    for every_ten, every_step in per_rank:
        assert every_ten == {"take": 2, "mean_over": 1}, every_ten
        assert every_step == {"take": STEPS, "mean_over": 1}, every_step
    logged, stepped = ([json.loads(line) for line in Path(m).read_text().splitlines()]
                       for _, _, m in runs)
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1)) + [STEPS]  # + eval
    assert [list(r) for r in logged] == [list(r) for r in stepped]
    for got, want in zip(logged, stepped, strict=True):
        for key in ("step", "loss", "grad_norm", "lr", "sent_bytes", "eval_loss"):
            assert got.get(key) == want.get(key), (got["step"], key)


def _grid_groups(rank: int) -> tuple[ThreadGroup, ThreadGroup]:
    """On 8 thread ranks laid out sync 2 x dp 2 x tp 2 (sync outermost, as the mesh lays
    it): this rank's dp group (a loss group) and its sync group."""
    fabric = comm.resolve(None).fabric
    block, tp = rank - rank % 4, rank % 2
    dp = ThreadGroup(fabric, (rank % 4) // 2, [block + tp, block + 2 + tp],
                     name=f"dp{block}-{tp}")
    sync = ThreadGroup(fabric, rank // 4, [rank % 4, rank % 4 + 4], name=f"sync{rank % 4}")
    return dp, sync


def _averaged_both_ways(rank: int, losses: list[float]) -> tuple[float, float]:
    dp, sync = _grid_groups(rank)
    try:
        now = StepLoss(dp, sync, torch.device("cpu"), gathered=False).now(losses[rank])
        gathered = StepLoss(dp, sync, torch.device("cpu"), gathered=True).of(losses)
    finally:
        dp.executor.close()
        sync.executor.close()
    return now, gathered


@pytest.mark.timeout(30)
def test_a_gathered_loss_is_the_all_reduced_one_bit_for_bit() -> None:
    """Losses of float32 values on 8 ranks (sync 2 x dp 2 x tp 2): the mean over each dp
    group, then over the sync groups, from one gather equals the two all-reduces'."""
    for trial in range(20):
        draw = random.Random(trial)
        losses = [float(torch.tensor(draw.uniform(0.5, 12.0), dtype=torch.float32))
                  for _ in range(8)]
        for now, gathered in run_threads(_averaged_both_ways, 8, losses):
            assert now == gathered, (trial, now, gathered)


def _kept_and_taken(rank: int) -> dict[str, Any]:
    """Two thread ranks keep 4 steps (rank 1 busy three times as long), then take them."""
    speed = StepSpeed(ModelFlops(1e6, "test"), Peak(1.0, "test"), ranks=2,
                      device=torch.device("cpu"), group=None, gather=True, every=2)
    world = comm.resolve(None)
    for step in range(1, 5):
        speed.begin()
        speed.keep(step, 0.3 if rank == 1 else 0.1, 1000.0, carried=float(rank + step))
    before = world.seq
    taken = speed.take()
    return {"collectives": world.seq - before, "taken": taken, "again": speed.take()}


@pytest.mark.timeout(30)
def test_steps_kept_are_taken_in_one_all_gather_with_each_steps_figures() -> None:
    for result in run_threads(_kept_and_taken, 2):
        assert result["collectives"] == 1 and result["again"] == []
        taken = result["taken"]
        assert [m.step for m in taken] == [1, 2, 3, 4]
        assert [m.carried for m in taken] == [[1.0, 2.0], [2.0, 3.0], [3.0, 4.0], [4.0, 5.0]]
        assert all(m.figures["slowest_rank"] == 1 and m.figures["slowest_busy_s"] == 0.3
                   for m in taken)
        assert [m.straggler for m in taken] == \
            ["", "straggler: rank 1 took 0.3 s, 1.5x the median"] * 2
