"""Fixtures shared by several test modules."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from dtrain.comm.ops import AVAILABLE


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
def native(tmp_path_factory) -> dict[str, str]:
    """The environment of ranks whose collectives take their native algorithm at once: a
    calibration file (dtrain.comm.cost) where it is the fastest, so that `auto` spends no
    seconds timing candidates on probe tensors (the planner's checks against measured
    peaks: tests/test_plan.py, tests/test_plan_cp.py)."""
    path = tmp_path_factory.mktemp("calibration") / "calibration.json"
    curves = {f"gloo/size{n}/{op}": {a: [[4096, 1e-5 if a == "native" else 1e-3],
                                         [16 << 20, 1e-2 if a == "native" else 1.0]]
                                     for a in algorithms}
              for n in (2, 4) for op, algorithms in AVAILABLE.items() if len(algorithms) > 1}
    path.write_text(json.dumps(curves))
    return {"DTRAIN_CALIBRATION": str(path)}

