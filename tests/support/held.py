"""Processes a test looks at from outside (their parents and states in /proc), and a rank
a drill holds still (SIGSTOP, dtrain.faults) let go once its launcher has told it to stop.

A stopped rank does not act on the SIGTERM with which its agent ends a round until it is
continued; the launcher's waker continues it once another rank of the machine has exited
(dtrain.launch.waker), but a machine of one rank has no other, and the agent then waits
its 30 s grace before the SIGKILL. A drill holding the only rank of a machine lets it go
itself, once the SIGTERM is pending: the rank then ends where it was held, as it would
have after the grace.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

from tests.support.forked import Launched
from tests.support.poll import until


def _processes() -> dict[int, tuple[str, int]]:
    """Every process now: its state letter (R, S, T...) and its parent, by pid."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, parent = stat.read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        found[int(stat.parent.name)] = (state, int(parent))
    return found


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    return [child for child, (_, parent) in _processes().items() if parent == pid]


def stopped_descendants(pid: int) -> list[int]:
    """The processes under `pid` (at any depth) that are stopped (state T)."""
    processes = _processes()
    found = []
    for child, (state, above) in processes.items():
        while above in processes and above != pid:
            above = processes[above][1]
        if above == pid and state == "T":
            found.append(child)
    return found


def told_to_stop(pid: int) -> bool:
    """Whether `pid` has a SIGTERM pending (its agent ended it while a drill held it)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return False
    status = dict(line.split(":", 1) for line in lines if ":" in line)
    pending = int(status.get("ShdPnd", "0"), 16) | int(status.get("SigPnd", "0"), 16)
    return bool(pending & (1 << (signal.SIGTERM - 1)))


def release_when_told_to_stop(launcher: Launched, timeout: float, what: str,
                              describe: Callable[[], str] = lambda: "") -> None:
    """Continue (SIGCONT) the held rank under `launcher` once its agent has sent it
    SIGTERM, waiting up to `timeout` seconds while the launcher runs; `what` and
    `describe` say what was awaited in a failure."""

    def released() -> bool:
        held = [pid for pid in stopped_descendants(launcher.pid) if told_to_stop(pid)]
        for pid in held:
            os.kill(pid, signal.SIGCONT)
        return bool(held)

    until(released, timeout, what, running=[launcher.poll], describe=describe)
