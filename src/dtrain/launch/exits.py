"""Which rank failed first: each rank notes when it exits, the launcher reads the notes.

When one rank fails, the others usually fail a moment later ("connection closed by peer")
and the agent's own timestamps (whole seconds) cannot tell them apart. Each rank started
by `dtrain run` writes the time its program ends (before the exit's clean-up: leaving the
process group can take a while) to a file named after its rank (dtrain.launch.bootstrap);
the launcher blames the failed rank that ended first. A rank that wrote nothing (killed
by a signal) is taken to have failed first, unless it died of the SIGTERM the agent sends
to stop the survivors.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from dtrain import env


def note_exit_time(rank: int | str) -> None:
    """In a rank: note now, as the time this process exits, for the launcher (if it asked)."""
    folder = env.EXIT_DIR.get()
    if folder and str(rank):
        (Path(folder) / str(rank)).write_text(repr(time.time()))


def first_failed(exit_codes: dict[int, int], folder: str) -> int:
    """In the launcher: of the failed ranks (rank -> exit code), the one that failed first."""

    def order(rank: int) -> tuple[bool, float, int]:
        try:
            return False, float((Path(folder) / str(rank)).read_text()), rank
        except (OSError, ValueError):
            stopped_by_agent = exit_codes[rank] == -signal.SIGTERM
            return stopped_by_agent, float("-inf"), rank

    return min(exit_codes, key=order)
