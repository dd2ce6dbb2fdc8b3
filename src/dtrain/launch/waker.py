"""Stopped ranks are continued once their job ends, so that the signal that ends it lands.

A rank stopped by SIGSTOP (a stalled machine, a debugger that let go, a drill) does not act
on the SIGTERM with which the agent stops a failed job until it is continued; the agent
SIGKILLs it only after a grace of 30 s. So once any rank of this machine has exited, a
thread of the launcher sends SIGCONT to every rank's process group, every half second,
until the job is over: the pending SIGTERM then takes effect at once. Before that, a
stopped rank is left alone.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from dtrain.launch.watch import Watcher

PERIOD_S = 0.5


class Waker(Watcher):
    """Watches this launcher's ranks (its child processes) from a thread until `stop()`."""

    name = "dtrain-waker"

    def __init__(self) -> None:
        self.start()

    def _run(self) -> None:
        seen: set[int] = set()
        while not self.stopped.wait(PERIOD_S):
            ranks = _children()
            ended = any(state == "Z" for state in ranks.values()) or bool(seen - set(ranks))
            seen |= set(ranks)
            if ended:
                for pid in ranks:
                    try:
                        os.killpg(pid, signal.SIGCONT)  # each rank leads its own group
                    except OSError:
                        pass


def _children() -> dict[int, str]:
    """pid -> state letter of every child of this process (from /proc; empty elsewhere)."""
    me, found = os.getpid(), {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            found[int(stat.parent.name)] = fields[0]
    return found
