"""Which rank failed first: each rank notes when it exits, the launcher reads the notes.

When one rank fails, the others usually fail a moment later ("connection closed by peer")
and the agent's own timestamps (whole seconds) cannot tell them apart. Each rank started
by `dtrain run` writes the time it exits to a file named after its rank; the launcher
blames the failed rank that exited first. A rank that wrote nothing (killed, or crashed
before `dtrain.init()`) is taken to have failed first, unless it died of the SIGTERM the
agent sends to stop the survivors.
"""

from __future__ import annotations

import atexit
import os
import signal
import time
from pathlib import Path

ENV = "DTRAIN_EXIT_DIR"


def record_exit_time(rank: int) -> None:
    """In a rank: note the time of this process's exit for the launcher (if it asked)."""
    folder = os.environ.get(ENV)
    if folder:
        atexit.register(lambda: (Path(folder) / str(rank)).write_text(repr(time.time())))


def first_failed(exit_codes: dict[int, int], folder: str) -> int:
    """In the launcher: of the failed ranks (rank -> exit code), the one that failed first."""

    def order(rank: int) -> tuple[bool, float, int]:
        try:
            return False, float((Path(folder) / str(rank)).read_text()), rank
        except (OSError, ValueError):
            stopped_by_agent = exit_codes[rank] == -signal.SIGTERM
            return stopped_by_agent, float("-inf"), rank

    return min(exit_codes, key=order)
