"""`dtrain bench comm`: every algorithm measured, nccl-tests' bandwidths, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dtrain.comm import AVAILABLE
from dtrain.comm.select import PROBE_BYTES
from dtrain.errors import ConfigError
from dtrain.sizes import parse_size
from dtrain.tools.comm_bench import element_count, message_sizes
from tests.support.cli import dtrain

KEYS = {"op", "backend", "algorithm", "world_size", "bytes", "time_us", "algbw_gbps",
        "busbw_gbps", "chosen"}
BUS_FACTOR_2_RANKS = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5,
                      "broadcast": 1.0}
QUICK = ("--iters", "2", "--warmup", "1")


@pytest.mark.slow
def test_json_has_every_algorithm_with_nccl_tests_bandwidths(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = dtrain("bench", "comm", "-n", "2", "--max-bytes", "64K", *QUICK, "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "busbw(GB/s)" in result.stdout
    records = json.loads(out.read_text())
    assert records and all(set(r) == KEYS for r in records)
    sizes = message_sizes(4, 64 << 10, 4)
    for op, factor in BUS_FACTOR_2_RANKS.items():
        mine = [r for r in records if r["op"] == op]
        assert {r["algorithm"] for r in mine} == {*AVAILABLE[op], "auto"}
        for algorithm in {*AVAILABLE[op], "auto"}:
            measured = sorted(r["bytes"] for r in mine if r["algorithm"] == algorithm)
            assert measured == [element_count(op, s, 2) * 4 for s in sizes]
        for r in mine:
            assert (r["backend"], r["world_size"]) == ("gloo", 2)
            assert r["time_us"] > 0
            assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["time_us"] / 1e3)
            assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor)
            if r["algorithm"] == "auto":
                assert r["chosen"] in AVAILABLE[op]
            else:
                assert r["chosen"] == ""


@pytest.mark.slow
def test_shm_and_gloo_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = dtrain("bench", "comm", "-n", "2", "--backend", "shm,gloo", "--ops", "all_reduce",
                    "--algorithms", "native", "--max-bytes", "1M", *QUICK, "--json", str(out))
    assert result.returncode == 0, result.stderr
    records = json.loads(out.read_text())
    expected = [element_count("all_reduce", s, 2) * 4 for s in message_sizes(4, 1 << 20, 4)]
    for backend in ("shm", "gloo"):
        assert [r["bytes"] for r in records if r["backend"] == backend] == expected


def test_sizes_parse_in_powers_of_1024_and_1000() -> None:
    assert parse_size("4") == 4
    assert parse_size("4K") == 4096
    assert parse_size("64k") == 64 << 10
    assert parse_size("16M") == 16 << 20
    assert parse_size("256MiB") == 256 << 20
    assert parse_size("1G") == 1 << 30
    assert parse_size("8B") == 8
    assert parse_size("1.5M") == 3 << 19
    assert parse_size("80GB") == 80 * 10**9
    for bad in ("", "0", "-4", "4X", "1.3B", "M"):
        with pytest.raises(ConfigError, match="not a size"):
            parse_size(bad)
    assert message_sizes(4, 256, 4) == [4, 16, 64, 256]
    assert element_count("all_gather", 4, 2) == 2  # one float32 for each rank


@pytest.mark.slow
def test_calibrate_under_dtrain_run_saves_the_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calibration = tmp_path / "calibration.json"
    monkeypatch.setenv("DTRAIN_CALIBRATION", str(calibration))
    result = dtrain("run", "-n", "2", "-m", "dtrain.cli", "bench", "comm", "--calibrate",
                    "--ops", "all_reduce,broadcast", "--max-bytes", "1K", *QUICK)
    assert result.returncode == 0, result.stderr
    assert str(calibration) in result.stdout
    saved = json.loads(calibration.read_text())
    chosen = {op for op in ("all_reduce", "broadcast") if len(AVAILABLE[op]) > 1}
    assert {key.rsplit("/", 1)[1] for key in saved} == chosen  # only the ops asked for
    for op in chosen:
        curves = saved[f"gloo/size2/{op}"]
        assert set(curves) == set(AVAILABLE[op])
        for points in curves.values():  # [bytes, seconds] at each probe size
            assert [b for b, _ in points] == list(PROBE_BYTES)
            assert all(seconds > 0 for _, seconds in points)
