"""benchmarks/fault_results.py, the script behind RESULTS.md's table of faults, names today's
tests: each of its rows a test function of the tree, each drill of `make soak` a row with
its rounds; and it renders a JUnit report into the table (without running anything)."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.paths import BENCHMARKS, ROOT


@pytest.fixture
def fault_results(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The script as a module (results_md beside it importable, as when it runs)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("fault_results",
                                                  BENCHMARKS / "fault_results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "fault_results", module)  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module


def test_every_row_names_a_test_of_the_tree_and_every_drill_has_one(
        fault_results: ModuleType) -> None:
    for test in fault_results.FAULTS:
        path, _, name = test.partition("::")
        tree = ast.parse((ROOT / path).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in names, f"{test}: no such test (renamed or folded away?)"
    drills = fault_results.soak_drills()
    assert drills, "no drills read from the Makefile"
    for test in drills:
        assert test in fault_results.FAULTS, f"make soak runs {test}: it needs a row"
        assert fault_results.FAULTS[test].rounds is not None, f"{test}: a drill's rounds"


REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.faults.test_faults"
  name="test_sigkill_at_random_moments_of_saving_never_loses_the_newest_checkpoint" time="3.0"/>
<testcase classname="tests.launch.test_multihost" name="test_a_lost_host_is_named[B-killed]"
  time="40"><system-out>host A stopped 7.5s after B was killed: ...</system-out></testcase>
<testcase classname="tests.launch.test_multihost" name="test_a_lost_host_is_named[A-killed]"
  time="40"><failure message="AssertionError: took 13 s&#10;more">...</failure></testcase>
<testcase classname="tests.ft.test_host_loss"
  name="test_losing_any_host_rank_0s_first_loses_no_step" time="1">
  <skipped message="needs root (network namespaces)"/></testcase>
<testcase classname="tests.config.test_bad_input" name="test_bad_config[x]" time="0.1"/>
</testsuite></testsuites>
"""


def test_a_report_becomes_the_table_with_its_counts_date_and_commit(
        fault_results: ModuleType, tmp_path: Path) -> None:
    report = tmp_path / "faults.xml"
    report.write_text(REPORT)
    found = fault_results.outcomes(report)
    lines = fault_results.section(found, 2.0, count="3", only="saving or lost_host",
                                  write=False)
    text = "\n".join(lines)
    assert "`python benchmarks/fault_results.py --count 3 --only 'saving or lost_host'`" in text
    assert "at commit " in text and "each soak drill 3 round(s)" in text
    saving = next(line for line in lines if "a loop of blocking saves" in line)
    assert "| 3 | 3/3: " in saving  # 3 rounds of one kill each
    lost = next(line for line in lines if "host B-killed, A-killed" in line)
    assert "| 2 | 1/2: " in lost and "measured: median 7.5 s" in lost
    assert "| failure: AssertionError: took 13 s |" in text
    assert "skipped: needs root (network namespaces)" in text
    assert "| 1/1: one clear line and exit 2" in text
    assert text.endswith("Totals, without malformed input: 5 faults injected, 4 recovered "
                         "as promised.")
    quick = fault_results.section(found, 2.0, count="quick", only="x", write=False)
    assert "| 5 | 5/5: " in next(line for line in quick if "blocking saves" in line)
    # a full run's command is the one that writes RESULTS.md
    full = fault_results.section(found, 300.0, count="full", only=None, write=True)
    assert "Command: `python benchmarks/fault_results.py --write`" in full[2]
    assert "the soak drills at the counts of `make soak`" in full[2]


@pytest.mark.parametrize("flags, message", [
    (["--count", "0"], "--count '0': give a number of rounds (1 or more) or 'quick'"),
    (["--count", "2", "--write"], "--write puts the full run in RESULTS.md: drop --count"),
    (["--only", "etcd", "--write"], "--write puts the full run in RESULTS.md"),
])
def test_a_partial_run_is_never_written_and_a_bad_count_is_one_line(
        flags: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, str(BENCHMARKS / "fault_results.py"), *flags],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fault_results: error: {message}"), \
        done.stderr
