"""One rank of a live replica of `dtrain train` (`[fault_tolerance] mode = "live"`):
`python -m dtrain.launch.supervisor RESTARTS [--standby] -- COMMAND...`.

The elastic agent would stop every rank when one fails. Under live replicas each rank runs
inside this supervisor instead. The job's ranks form replicas of DTRAIN_LIVE_RANKS consecutive
ranks (dp x tp x pp of the config; one by default): the rank (COMMAND) sees the world of its
replica, under bootstrap keys of that replica's generation, and its replica id
(dtrain.ft.live.job). When a rank of a replica dies, its supervisor starts a new generation
of the replica (a counter in the job's store); the supervisors of the other ranks see it,
stop their rank (alive, but its replica's groups are broken) and start it again in the new
generation, up to RESTARTS times each. The new ranks recover the model, optimizer state and
position from a live replica. With no restart left the supervisor exits 0: the other
replicas go on without this one, and the agent does not stop them. A rank that exits 2 (a
mistake in the job, said in one line) is not started again.

With `--standby` (`[fault_tolerance] standby`, the default) and a restart left, the
supervisor keeps a warm standby beside the rank once the rank has taken part in a step
(it says so through a pipe, DTRAIN_LIVE_READY_FD: the standby does not slow the job's
start, when every rank imports and builds at once): a process that has started Python
and imported what the rank imports, and waits (dtrain.launch.standby). The next
generation's rank is that process, sent its environment, instead of a fresh one; if it
died, a fresh one is started. The supervisor then keeps a new standby beside the new
rank, while restarts are left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch.distributed as dist

from dtrain import env
from dtrain.launch import standby as standby_mod
from dtrain.launch.standby import Standby
from dtrain.store import connect, prefixed

POLL = 0.1  # seconds between looks at the rank and at its replica's generation


def command(restarts: int, argv: list[str], standby: bool = True) -> list[str]:
    """`argv` run as a rank of a live replica, restarted in place up to `restarts` times,
    each time from a warm standby process when `standby` (and `argv` is a Python program)."""
    return [sys.executable, "-u", "-m", "dtrain.launch.supervisor", str(restarts),
            *(["--standby"] if standby else []), "--", *argv]


RETIRED = "retired"  # a generation that never comes: a rank of the replica has no restart left


def _generations(replica: int, store: dist.Store | None = None):
    """The job store's generation counter of `replica`: read it (-1 once retired), and
    bump it from a given generation (to RETIRED with `retire`)."""
    store = prefixed(f"dtrain/live/{env.RUN_ID.get() or ''}/generation/", store or connect())
    key = str(replica)
    store.compare_set(key, "", "0")  # the first generation, whoever comes first

    def current() -> int:
        value = store.get(key).decode()
        return -1 if value == RETIRED else int(value)

    def bump(seen: int, retire: bool) -> None:
        store.compare_set(key, str(seen), RETIRED if retire else str(seen + 1))

    return current, bump


def next_generation(store: dist.Store, replica: int) -> None:
    """Start a new generation of `replica` (unless retired): a launcher that took a lost
    machine's place does, so its ranks recover from a live peer and the replica's ranks
    elsewhere start again with them."""
    current, bump = _generations(replica, store)
    seen = current()
    if seen >= 0:
        bump(seen, retire=False)


def main(argv: list[str]) -> int:
    split = argv.index("--")
    restarts, warm, program = int(argv[0]), "--standby" in argv[1:split], argv[split + 1:]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ranks = env.LIVE_RANKS.get()
    replica, position = divmod(rank, ranks)
    attempt = env.ATTEMPT.get() or ""
    os.environ.update({**env.LIVE_ID.pair(replica), **env.LIVE_SLOTS.pair(world // ranks),
                       "RANK": str(position), "WORLD_SIZE": str(ranks),  # its replica's
                       "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1"})  # (LOCAL_RANK: its GPU)
    env.EXIT_DIR.unset()  # this process notes the exit time, not its child
    current, bump = _generations(replica)
    stopping: list[int] = []
    child: subprocess.Popen | None = None

    def forward(signum: int, _frame: object) -> None:
        stopping.append(signum)
        if child is not None:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    who = f"replica {replica}" + (f" (its rank {position})" if ranks > 1 else "")
    standby: Standby | None = None
    try:
        for restart in range(restarts + 1):
            generation = current()
            if generation < 0:
                break  # the replica is gone for good
            env.LIVE_INCARNATION.set(generation)
            env.ATTEMPT.set(f"{attempt}-live{replica}-g{generation}")
            taken = standby.take(os.environ) if standby is not None else None
            # either way the rank dies with this process
            child, ready = taken or standby_mod.start(program)
            standby = None
            while (code := child.poll()) is None and current() == generation:
                if warm and standby is None and restart < restarts and ready.seen():
                    standby = Standby.of(program)
                    warm = standby is not None  # a program that is not Python: never
                time.sleep(POLL)
            ready.close()
            if code is None:  # another rank of the replica died: this one's groups are broken
                child.kill()
                child.wait()
                how = "lost a rank"
            elif code in (0, 2) or stopping:  # done, a mistake to fix (one line said), or stopped
                return 128 - code if code < 0 else code
            else:
                bump(generation, retire=restart == restarts)
                how = (f"was killed by {signal.Signals(-code).name}" if code < 0
                       else f"exited with code {code}")
            left = restarts - restart if current() >= 0 else 0
            if left:
                warmed = " from its warm standby" if standby is not None else ""
                print(f"dtrain: {who} {how}; started again{warmed}, it recovers from a live "
                      f"peer ({left - 1} restart(s) left)", file=sys.stderr, flush=True)
            else:
                print(f"dtrain: {who} {how}; the other replicas go on without it",
                      file=sys.stderr, flush=True)
    finally:
        if standby is not None:
            standby.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
