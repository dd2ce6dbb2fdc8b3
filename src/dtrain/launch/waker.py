"""A launcher's watch over its ranks' processes: stopped ranks are continued once the job
ends, and a rank stopped for too long is taken for a failure.

A rank stopped by SIGSTOP (a stalled machine, a debugger that let go, a drill) does not act
on the SIGTERM with which the agent stops a failed job until it is continued; the agent
SIGKILLs it only after a grace of 30 s. So once any rank of this machine has exited, a
thread of the launcher sends SIGCONT to the process group of every rank that was running
with it, every half second, until they are gone: the pending SIGTERM then takes effect at
once. Ranks started afterwards (a restart, a new round) are left alone.

A rank that stays stopped holds every other rank in its next collective until that
collective times out (minutes). So a rank found stopped (state T; a debugger's tracing stop
is t and is left alone) for `stall_s` seconds is SIGKILLed: its failure is then seen at
once, and the launcher's error line says why (`stalled`).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from dtrain import env
from dtrain.launch.watch import Watcher

PERIOD_S = 0.5


def stall_timeout() -> float:
    """Seconds a rank may stay stopped before it is failed (env DTRAIN_STALL_TIMEOUT;
    0: never)."""
    return env.STALL_TIMEOUT.get()


class Waker(Watcher):
    """Watches this launcher's ranks (its child processes) from a thread until `stop()`.

    Attributes:
        stalled: pid -> seconds it had been stopped, of each rank killed for stalling.
    """

    name = "dtrain-waker"

    def __init__(self, stall_s: float | None = None) -> None:
        self.stall_s = stall_timeout() if stall_s is None else stall_s
        self.stalled: dict[int, float] = {}
        self.start()

    def _run(self) -> None:
        alive: set[int] = set()  # the ranks seen last time
        doomed: set[int] = set()  # ranks alive when one of their group ended
        stopped_since: dict[int, float] = {}
        while not self.stopped.wait(PERIOD_S):
            ranks = children()
            if any(state == "Z" for state in ranks.values()) or alive - set(ranks):
                doomed |= set(ranks)
            alive = set(ranks)
            doomed &= alive  # ranks started afresh (a restart, a new round) are not
            now = time.monotonic()
            stopped_since = {pid: stopped_since.get(pid, now)
                             for pid, state in ranks.items() if state == "T"}
            for pid, since in stopped_since.items():
                if self.stall_s and now - since >= self.stall_s and pid not in self.stalled:
                    self.stalled[pid] = now - since
                    _signal(pid, signal.SIGKILL)
            for pid in doomed:
                _signal(pid, signal.SIGCONT, group=True)  # each rank leads its own group


def _signal(pid: int, sig: signal.Signals, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except OSError:
        pass


def children(parent: int | None = None) -> dict[int, str]:
    """pid -> state letter of every child of `parent` (default: this process; from /proc,
    empty elsewhere)."""
    me, found = parent or os.getpid(), {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            found[int(stat.parent.name)] = fields[0]
    return found
