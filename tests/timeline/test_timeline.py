"""dtrain.timeline: one Chrome-trace file with every rank's collectives and training spans."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from dtrain import timeline
from dtrain import world as world_mod
from tests.support.calibration import write_calibration
from tests.support.cli import TINY_MODEL, dtrain

COLLECTIVES = """
import torch, dtrain
from dtrain import comm

world = dtrain.init()
t = torch.arange(8, dtype=torch.float32)
with dtrain.timeline.span("exchange", round=1):
    comm.all_reduce(t, algorithm="ring")
    comm.all_reduce(t, async_op=True, algorithm="tree").wait()
    comm.all_gather(t, algorithm="ring")
    comm.broadcast(t, src=0, algorithm="tree")
    comm.reduce_scatter(t, algorithm="native")
    comm.reduce(t, dst=0, algorithm="native")
    comm.gather(t, dst=0)
    comm.scatter(t, src=0)
    comm.all_to_all(t)
    comm.barrier()
    if world.rank == 0:
        comm.send(t, dst=1)
    else:
        comm.recv(t, src=0)
print("recording", dtrain.world.recorder() is not None)
"""
KINDS = {"all_reduce", "all_gather", "broadcast", "reduce_scatter", "reduce", "gather",
         "scatter", "all_to_all", "barrier"}

TINY = TINY_MODEL + """
[data]
max_bytes = 50000

[train]
steps = 3
batch_size = 8
eval_every = 0
eval_batches = 1

[logging]
sample_tokens = 0
"""


def _spans(path: Path) -> list[dict]:
    return [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


@pytest.mark.timeout(60)
def test_run_merges_every_rank_and_collective(tmp_path: Path) -> None:
    out = tmp_path / "traces" / "t.json"
    result = dtrain("run", "-n", "2", "--timeline", "traces/t.json", _script(tmp_path, COLLECTIVES),
                    timeout=50, cwd=str(tmp_path))  # relative to where dtrain runs
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"written to {out}" in result.stdout
    assert sorted(p.name for p in out.parent.iterdir()) == ["t.json"]  # the parts are gone
    spans = _spans(out)
    for rank in (0, 1):
        comm = [e for e in spans if e["pid"] == rank and e["cat"] == "comm"]
        assert {e["name"] for e in comm} >= KINDS
        assert all(e["dur"] >= 0 and e["args"]["bytes"] > 0 and e["args"]["group_size"] == 2
                   for e in comm)
        user = [e for e in spans if e["pid"] == rank and e["cat"] == "user"]
        assert [(e["name"], e["args"]) for e in user] == [("exchange", {"round": 1})]
        assert all(user[0]["ts"] <= e["ts"] <= user[0]["ts"] + user[0]["dur"] for e in comm)
    by = {(e["pid"], e["name"], e["args"]["algorithm"], e["args"]["async"]) for e in spans
          if e["cat"] == "comm"}
    assert (0, "all_reduce", "tree", True) in by and (1, "all_reduce", "ring", False) in by
    assert (0, "send", "native", False) in by and (1, "recv", "native", False) in by
    gathered = next(e for e in spans if e["name"] == "all_gather")
    assert gathered["args"]["bytes"] == 2 * 8 * 4  # the whole gathered buffer
    names = {(e["pid"], e["args"]["name"]) for e in json.loads(out.read_text())["traceEvents"]
             if e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}


def _calibrated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Saved cost curves for 2 gloo ranks, so `auto` picks without measuring first (the
    measuring takes seconds); "ring" is cheapest wherever there is one."""
    monkeypatch.setenv("DTRAIN_CALIBRATION", str(tmp_path / "calibration.json"))
    write_calibration(tmp_path / "calibration.json")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_train_records_steps_phases_and_collectives_of_every_rank(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _calibrated(tmp_path, monkeypatch)
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    out = tmp_path / "t.json"
    result = dtrain("train", str(config), "--set", f"train.out_dir='{tmp_path / 'run'}'",
                    "--timeline", str(out), timeout=80)
    assert result.returncode == 0, result.stdout + result.stderr
    spans = _spans(out)
    for rank in (0, 1):
        cats = {e["cat"] for e in spans if e["pid"] == rank}
        assert cats >= {"step", "data", "forward", "backward", "optimizer", "comm"}
        steps = [e["args"]["step"] for e in spans if e["pid"] == rank and e["cat"] == "step"]
        assert steps == [1, 2, 3]
    assert "auto" not in {e["args"]["algorithm"] for e in spans if e["cat"] == "comm"}
    assert {e["args"]["algorithm"] for e in spans if e["name"] == "all_reduce"} == {"ring"}
    seconds = timeline.summarize(out)
    assert set(seconds) == {0, 1} and all(0 < s["comm"] and 0 < s["step"]
                                          for s in seconds.values())


@pytest.mark.timeout(60)
def test_one_process_train_writes_the_timeline_itself(tmp_path: Path) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text(TINY + 'timeline = "t.json"\n')  # in [logging], relative to the cwd
    result = dtrain("train", str(config), "-n", "1", "--set", "train.out_dir='run'",
                    timeout=50, cwd=str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    spans = _spans(tmp_path / "t.json")
    assert {e["cat"] for e in spans} >= {"step", "data", "forward", "backward", "optimizer"}
    assert {e["pid"] for e in spans} == {0}
    assert not list(tmp_path.glob("t.json.rank-*"))


@pytest.mark.timeout(60)
def test_a_failed_run_still_merges_the_parts_written(tmp_path: Path) -> None:
    body = """
    import sys, time, torch, dtrain
    from dtrain import comm
    world = dtrain.init()
    comm.all_reduce(torch.ones(4), algorithm="native")
    if world.rank == 1:
        sys.exit(3)
    time.sleep(30)  # stopped by the launcher: this rank writes nothing
    """
    out = tmp_path / "t.json"
    result = dtrain("run", "-n", "2", "--timeline", str(out), _script(tmp_path, body),
                    timeout=50)
    assert result.returncode == 3, result.stdout + result.stderr
    assert {e["pid"] for e in _spans(out) if e["name"] == "all_reduce"} == {1}
    assert not list(tmp_path.glob("t.json.rank-*"))


@pytest.mark.timeout(60)
def test_off_writes_nothing(tmp_path: Path) -> None:
    result = dtrain("run", "-n", "2", _script(tmp_path, COLLECTIVES), timeout=50,
                    cwd=str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[rank0] recording False" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.py"]


def test_span_is_a_shared_no_op_when_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DTRAIN_TIMELINE", raising=False)
    assert world_mod.recorder() is None
    with timeline.span("anything", size=1) as inside:
        assert inside is None
    assert timeline.span("a") is timeline.span("b", x=2)  # nothing allocated per call


def test_bad_folder_is_one_error_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = dtrain("run", "--timeline", str(blocker / "t.json"), _script(tmp_path, "pass"),
                    timeout=30)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "dtrain: error: timeline" in result.stderr and "cannot create its folder" in \
        result.stderr


def test_recorder_lanes_merge_and_summary(tmp_path: Path) -> None:
    """Collectives in flight together get rows of their own; the summary counts the time
    covered by a category once; parts merge into one trace and are removed."""
    out = str(tmp_path / "t.json")
    parts = []
    for rank in (0, 1):
        rec = timeline.Recorder(out, rank)
        first = rec.begin_comm("all_reduce", 64, "ring", 2, True)
        second = rec.begin_comm("all_gather", 128, "native", 2, True)
        assert (first.lane, second.lane) == (0, 1)
        first.end()
        second.end()
        assert rec.begin_comm("barrier", 4, "native", 2, False).lane == 0
        with rec.span("step", "step", {"step": 1}):
            pass
        rec.close()
        parts.append(timeline.part_path(out, rank))
    assert timeline.merge(parts, out) == 2
    assert not any(p.exists() for p in parts)
    spans = _spans(Path(out))
    assert {(e["pid"], e["tid"]) for e in spans if e["name"] == "all_gather"} == {(0, 2), (1, 2)}
    summary = timeline.summarize(out)
    assert set(summary) == {0, 1} and set(summary[0]) == {"comm", "step"}
    events = [{"ph": "X", "pid": 0, "cat": "comm", "ts": ts, "dur": dur}
              for ts, dur in ((0, 4e6), (1e6, 1e6), (5e6, 1e6))]
    assert timeline.summarize(events) == {0: {"comm": 5.0}}
