"""One live replica of `dtrain train` (`[parallel] fault_tolerance = "live"`):
`python -m dtrain.launch.replica RESTARTS -- COMMAND...`.

The elastic agent would stop every rank when one fails. Under live replicas each rank runs
inside this supervisor instead: the rank (COMMAND) sees a world of one process and its
replica id (dtrain.train.live), and when it dies the supervisor starts it again in place,
up to RESTARTS times; the new process recovers the model, optimizer and position from a
live peer. With no restart left the supervisor exits 0: the other replicas go on without
it, and the agent does not stop them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from dtrain.launch import bootstrap, exits
from dtrain.train.live import ID_ENV, INCARNATION_ENV, SLOTS_ENV


def command(restarts: int, argv: list[str]) -> list[str]:
    """`argv` run as a live replica, restarted in place up to `restarts` times."""
    return [sys.executable, "-u", "-m", "dtrain.launch.replica", str(restarts), "--", *argv]


def main(argv: list[str]) -> int:
    restarts, program = int(argv[0]), argv[2:]  # after "--"
    replica = os.environ["RANK"]
    os.environ.update({ID_ENV: replica, SLOTS_ENV: os.environ["WORLD_SIZE"], "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1"})
    os.environ.pop(exits.ENV, None)  # this process notes the exit time, not its child
    stopping: list[int] = []
    child: subprocess.Popen | None = None

    def forward(signum: int, _frame: object) -> None:
        stopping.append(signum)
        if child is not None:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    for incarnation in range(restarts + 1):
        os.environ[INCARNATION_ENV] = str(incarnation)
        child = subprocess.Popen(bootstrap.command(program))  # dies with this process
        code = child.wait()
        if code == 0 or stopping:
            return 128 - code if code < 0 else code
        how = (f"was killed by {signal.Signals(-code).name}" if code < 0
               else f"exited with code {code}")
        if incarnation < restarts:
            print(f"dtrain: replica {replica} {how}; started again, it recovers from a live "
                  f"peer ({restarts - incarnation - 1} restart(s) left)", file=sys.stderr,
                  flush=True)
        else:
            print(f"dtrain: replica {replica} {how}; the other replicas go on without it",
                  file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
