"""A rank's warm standby (dtrain.launch.standby): a process started ahead, that runs the
rank's program only when it is sent the rank's environment."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from dtrain import env
from dtrain.launch import standby

PROGRAM = """
import os, sys
from pathlib import Path
fd = int(os.environ["DTRAIN_LIVE_READY_FD"])
os.write(fd, b"1")
Path(sys.argv[1]).write_text(os.environ.get("WHO", "") + " " + " ".join(sys.argv[2:])
                             + " " + str(sys.stdin.read() == ""))
"""


@pytest.mark.timeout(120)
def test_a_standby_runs_the_rank_in_the_environment_it_is_sent(tmp_path: Path) -> None:
    """The standby, started before the environment exists, runs the script with the
    arguments it was started for and the environment sent (a variable the standby's own
    start did not have), its stdin empty; the rank says it trains through the Ready pipe.
    A standby let go without a rank is stopped, having run nothing; a command that is not
    Python has no standby."""
    script, out = tmp_path / "rank.py", tmp_path / "out.txt"
    script.write_text(PROGRAM)
    spare = standby.Standby.of([sys.executable, "-u", str(script), str(out), "a", "b"])
    assert spare is not None
    taken = spare.take({**os.environ, "WHO": "replacement"})
    assert taken is not None
    child, ready = taken
    assert child.wait(timeout=100) == 0
    assert out.read_text() == "replacement a b True"
    assert ready.seen()
    ready.close()

    unused = standby.Standby.of([sys.executable, str(script), str(tmp_path / "never.txt")])
    assert unused is not None
    unused.close()
    assert not (tmp_path / "never.txt").exists()
    assert standby.Standby.of(["/bin/true"]) is None
    assert standby.Standby.of([sys.executable, "-c", "pass"]) is None


def test_a_fresh_rank_gets_its_ready_pipe(tmp_path: Path) -> None:
    """Started without a standby, the rank is given the Ready pipe too; a rank that never
    writes to it is never taken for one that trains."""
    out = tmp_path / "fd.txt"
    child, ready = standby.start([sys.executable, "-c", "import os, sys; open(sys.argv[1], "
                                  "'w').write(os.environ['" + env.LIVE_READY_FD.name + "'])",
                                  str(out)])
    assert child.wait(timeout=60) == 0
    assert out.read_text().isdigit()
    assert not ready.seen()
    ready.close()
