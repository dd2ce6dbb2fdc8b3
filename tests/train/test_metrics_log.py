"""The metrics file in step order whoever writes it (dtrain.train.metrics.MetricsLog): a live
job's writer that takes over may record its steps before the one it replaces has written its
last; each record is put after every record of its step or an earlier one, under a lock that
the other writers (processes of their own) wait for."""

from __future__ import annotations

import json
import multiprocessing
import random
from pathlib import Path

import pytest

from dtrain.train import metrics
from dtrain.train.metrics import MetricsLog


def steps_in(path: Path) -> list[tuple[int, str]]:
    """(step, writer) of each line, in the file's order."""
    return [(r["step"], r.get("by", "")) for r in map(json.loads, path.read_text().splitlines())]


@pytest.mark.timeout(30)
def test_a_late_writers_record_goes_before_the_later_steps_of_the_one_that_took_over(
        tmp_path: Path) -> None:
    """Live replica 0 writes steps 1-4 and is slow to write 5; replica 1 takes over and
    writes 5 (missing) and 6; replica 0's late 5 goes after replica 1's, before 6."""
    path = tmp_path / "metrics.jsonl"
    first = MetricsLog(str(path), enabled=True)
    taking_over = MetricsLog(str(path), enabled=True, resumed=True)  # opened as it joined
    for step in range(1, 5):
        first.write({"step": step, "by": "first"})
    assert not taking_over.has(5) and taking_over.has(4)
    taking_over.write({"step": 5, "by": "next"})
    taking_over.write({"step": 6, "by": "next"})
    first.write({"step": 5, "by": "first"})
    taking_over.write({"step": 6, "eval_loss": 1.0, "by": "next"})  # the same step: after
    taking_over.write({"step": 7, "by": "next"})
    assert steps_in(path) == [(1, "first"), (2, "first"), (3, "first"), (4, "first"),
                              (5, "next"), (5, "first"), (6, "next"), (6, "next"), (7, "next")]
    first.close()
    taking_over.close()


@pytest.mark.timeout(30)
def test_a_record_goes_before_every_later_step_however_far_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records of later steps that fill more than the first window read: the window
    widens until it reaches the record's place (here the file's start)."""
    monkeypatch.setattr(metrics, "TAIL_BYTES", 64)
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(str(path), enabled=True)
    for step in range(10, 30):
        log.write({"step": step, "padding": "x" * 50})
    log.write({"step": 20})
    log.write({"step": 3})
    order = [step for step, _ in steps_in(path)]
    assert order == [3, *range(10, 21), 20, *range(21, 30)]


@pytest.mark.timeout(30)
def test_a_line_cut_short_is_left_whole_and_never_joined_to_the_next(tmp_path: Path) -> None:
    """A writer killed in the middle of a line: the next record starts a line of its own
    after it, and nothing is moved before it."""
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(str(path), enabled=True)
    log.write({"step": 1})
    log.write({"step": 3})
    with open(path, "ab") as f:
        f.write(b'{"step": 4, "lo')
    log.write({"step": 2})
    lines = path.read_text().splitlines()
    assert lines == ['{"step": 1}', '{"step": 3}', '{"step": 4, "lo', '{"step": 2}']
    log.write({"step": 5})  # after a whole line: in order again
    assert path.read_text().splitlines()[-1] == '{"step": 5}'


@pytest.mark.timeout(30)
def test_a_disabled_log_writes_nothing_and_a_new_run_starts_the_file_anew(
        tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 9}\n')
    MetricsLog(str(path), enabled=False).write({"step": 1})
    MetricsLog("", enabled=True).write({"step": 1})
    assert path.read_text() == '{"step": 9}\n'
    MetricsLog(str(path), enabled=True, resumed=True).write({"step": 10})
    assert steps_in(path) == [(9, ""), (10, "")]
    MetricsLog(str(path), enabled=True).write({"step": 1})
    assert steps_in(path) == [(1, "")]


def _write_steps(path: str, steps: list[int], seed: int) -> None:
    """A writer in a process of its own, its records a little out of step with the other's."""
    log = MetricsLog(path, enabled=True, resumed=True)
    pace = random.Random(seed)
    for step in steps:
        log.write({"step": step, "by": seed, "padding": "x" * pace.randrange(200)})


@pytest.mark.timeout(60)
def test_two_processes_writing_at_once_leave_every_record_whole_and_in_step_order(
        tmp_path: Path) -> None:
    """Two writers in processes of their own, each writing every step in turn from the
    same moment: no line is lost, torn or joined, and the file is in step order."""
    path = tmp_path / "metrics.jsonl"
    MetricsLog(str(path), enabled=True)  # the run's start: an empty file
    spawn = multiprocessing.get_context("spawn")
    writers = [spawn.Process(target=_write_steps, args=(str(path), list(range(1, 201)), seed))
               for seed in (0, 1)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=50)
        assert writer.exitcode == 0
    order = steps_in(path)
    assert sorted(order) == sorted((step, seed) for step in range(1, 201) for seed in (0, 1))
    steps = [step for step, _ in order]
    assert steps == sorted(steps)
