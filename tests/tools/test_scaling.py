"""`dtrain bench scaling`: a real scaling run on 1 and 2 workers, and its answer to bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dtrain.tools.scaling import comm_share
from tests.support.cli import TINY_MODEL, dtrain, one_error_line

TINY = TINY_MODEL + """
[data]
max_bytes = 100000

[train]
batch_size = 8
"""
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_one_and_two_workers_give_json_and_png(tmp_path: Path) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    report, png = tmp_path / "scaling.json", tmp_path / "scaling.png"
    result = dtrain("bench", "scaling", str(config), "--workers", "1,2", "--steps", "4",
                    "--warmup", "1", "--out", str(tmp_path / "runs"), "--json", str(report),
                    "--plot", str(png), timeout=110)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cores available" in result.stdout and "comm%" in result.stdout
    data = json.loads(report.read_text())
    rows = {(r["mode"], r["workers"]): r for r in data["rows"]}
    assert set(rows) == {("strong", 1), ("strong", 2), ("weak", 1), ("weak", 2)}
    assert [rows["strong", n]["global_batch"] for n in (1, 2)] == [8, 8]
    assert [rows["weak", n]["global_batch"] for n in (1, 2)] == [8, 16]
    for (_, workers), row in rows.items():
        assert row["samples_per_s"] > 0 and row["step_time_ms"] > 0
        assert row["steps_timed"] == 3
        assert row["efficiency"] == pytest.approx(row["speedup"] / workers)
        if workers == 2:
            assert 0 < row["comm_share"] < 1
    assert rows["strong", 1] == rows["weak", 1] | {"mode": "strong"}  # one run serves both
    assert data["machine"]["cores"] >= 1 and "bench scaling" in data["command"]
    assert png.read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("args", "named"), [
    (("--workers", "1,two"), "'two'"),
    (("--workers", "1,3", "--set", "train.batch_size=8", "--modes", "strong"), "3 worker"),
])
def test_bad_workers_get_one_error_line(tmp_path: Path, args: tuple[str, ...],
                                        named: str) -> None:
    result = dtrain("bench", "scaling", *args, "--out", str(tmp_path), timeout=25)
    assert result.returncode != 0
    assert named in one_error_line(result)


def test_comm_share_counts_overlaps_once_and_skips_warmup(tmp_path: Path) -> None:
    """Rank 0: step 2 (timed) lasts 10 us, with collectives on two threads covering 4 us
    of it and 1 us outside; rank 1: half of step 2 communicating. Step 1 is warm-up."""
    def span(cat: str, ts: float, dur: float, pid: int, **args: int) -> dict:
        return {"name": cat, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": pid,
                "tid": 0, "args": args}

    events = [span("step", 0, 10, 0, step=1), span("comm", 0, 10, 0),
              span("step", 10, 10, 0, step=2), span("comm", 11, 2, 0), span("comm", 12, 3, 0),
              span("comm", 18, 3, 0),
              span("step", 10, 10, 1, step=2), span("comm", 10, 5, 1)]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    assert comm_share(trace, warmup=1) == pytest.approx((0.6 + 0.5) / 2)
