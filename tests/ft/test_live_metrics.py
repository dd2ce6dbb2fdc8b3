"""A live job's metrics file stays in step order when the writer changes under a stalled
first live replica (dtrain.train.metrics.MetricsLog, the Trainer's record of each step).

`dtrain train -n 2` with live replicas: live replica 0, the writer, is held (SIGSTOP) once
step 5 is applied and before its record is written. Live replica 1 drops it, takes over,
records step 5 for it and goes on with its own steps. Continued (SIGCONT) several steps
later, replica 0 writes the record of step 5 it was holding, then rejoins from its peer.
Appended, that record would follow the later steps; it goes beside the other record of
step 5, before step 6. The job ends by itself, both live replicas with the same weights.
Slow (about half a minute).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.ft.test_elastic import launchers
from tests.ft.test_live import LIVE_JOB
from tests.support import forked
from tests.support.held import stopped_descendants
from tests.support.poll import until

__all__ = ["launchers"]  # the fixture that stops the job if the test fails

STEPS = 400
"""Long enough for live replica 0 to rejoin after it is continued (the steps take 20-30 ms
each), short enough that the job ends by itself."""


def records(metrics: Path) -> list[dict[str, object]]:
    """The records of training steps (not the held-out loss of the last step)."""
    if not metrics.exists():
        return []
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_stalled_writers_late_record_goes_in_step_order(
        tmp_path: Path, launchers: list[forked.Launched]) -> None:
    config, metrics, output = tmp_path / "job.toml", tmp_path / "metrics.jsonl", \
        tmp_path / "job.out"
    config.write_text(LIVE_JOB)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DTRAIN_FAULT": "stop@record=5,rank=0",
           "DTRAIN_STALL_TIMEOUT": "0"}  # the launcher leaves the held rank alone
    job = forked.start(["train", str(config), "-n", "2", "--metrics", str(metrics),
                        "--set", f"train.out_dir='{tmp_path / 'run'}'",
                        "--set", f"train.steps={STEPS}"], env=env, out=output)
    launchers.append(job)

    def steps() -> list[int]:
        return [int(str(r["step"])) for r in records(metrics)]

    def describe() -> str:
        return f"{steps()}\n{output.read_text(errors='replace')}"

    until(lambda: max(steps(), default=0) >= 9, 120, "steps 6-9 by live replica 1",
          running=[job.poll], describe=describe, every=0.2)
    held = stopped_descendants(job.pid)
    assert held, describe()
    os.kill(held[0], signal.SIGCONT)
    assert job.wait(timeout=150) == 0, describe()
    assert "the 2 live replicas end with the same weights" in output.read_text(), describe()
    recorded = steps()
    assert recorded == sorted(recorded), describe()  # in step order, the late one included
    assert sorted(set(recorded)) == list(range(1, STEPS + 1)), describe()
    assert [s for s in recorded if recorded.count(s) > 1] == [5, 5], describe()
    took_part = [r["live_replicas"] for r in records(metrics)]
    assert took_part[:6] == [2] * 6 and took_part[6] == 1, describe()  # 5 twice, then alone
    assert took_part[-1] == 2, describe()  # replica 0 back to the end
