"""Fixtures shared by several test modules, and the session's own environment."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.calibration import NATIVE_FIRST, write_calibration
from tests.support.tools import REQUIRE

NO_CI_MACHINE_HAS = ("needs CUDA", "needs two GPUs", "needs FP8 tensor cores")
"""The skips a CI machine (2 cores, no GPU) takes by design, whatever DTRAIN_REQUIRE_TOOLS says."""

BACKENDS = ("gloo", "threads", "shm")
"""The backends whose groups the tests build (cost curves ship for each, every size)."""
GROUP_SIZES = range(2, 9)


@pytest.fixture(scope="session", autouse=True)
def hermetic(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The whole session, and every process it starts, reads and writes none of the
    machine's own files: HOME and the caches (torch.compile's too) point into a folder of
    the session's, and `algorithm="auto"` reads a calibration made here (each operation's
    native algorithm the fastest), so no group times its candidates on a first run and no
    result depends on what an earlier run left behind. A test that measures points
    DTRAIN_CALIBRATION elsewhere itself. Yields the folder."""
    home = tmp_path_factory.mktemp("home")
    keys = ("HOME", "XDG_CACHE_HOME", "DTRAIN_CALIBRATION", "TORCHINDUCTOR_CACHE_DIR")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"),
                      TORCHINDUCTOR_CACHE_DIR=str(home / "inductor"),  # not /tmp's, shared
                      **write_calibration(home / "calibration.json", BACKENDS, GROUP_SIZES,
                                          NATIVE_FIRST))
    yield home
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def one_intra_op_thread() -> Iterator[None]:
    """The test process computes with one intra-op thread. Checking the collective matrix's
    million-element results costs seconds; with torch's intra-op threads, which on 2 cores
    only fight the ranks for them, it costs three times as long."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of ranks whose collectives take their native algorithm at once (a
    calibration file where it is the fastest), whatever the session's: the planner's
    checks against measured peaks (tests/planner/test_plan.py, test_plan_cp.py)."""
    return write_calibration(tmp_path_factory.mktemp("calibration") / "calibration.json",
                             ("gloo",), (2, 4), NATIVE_FIRST)



@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    _required(outcome.get_result())  # type: ignore[attr-defined]


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    _required(outcome.get_result())  # type: ignore[attr-defined]


def _required(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Where CI says every tool and package of the test extra is installed
    (DTRAIN_REQUIRE_TOOLS=1, .ci/run), a skip for a missing one (tests.support.tools.missing,
    pytest.importorskip) fails instead: a broken install cannot pass by skipping the tests
    it was meant to run. The skips of NO_CI_MACHINE_HAS stay skips."""
    if not report.skipped or os.environ.get(REQUIRE) != "1":
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not any(words in reason for words in NO_CI_MACHINE_HAS):
        report.outcome = "failed"
        report.longrepr = f"skipped ({reason}), but {REQUIRE}=1: this machine was to have it"
