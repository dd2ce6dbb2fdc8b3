"""Heartbeats: who is still running, noticed in seconds instead of at a collective's
timeout.

Each member of a group (a launcher of a multi-machine job, a rank of a live replica)
bumps a counter of its own in a store every `period` from a thread, and reads the others';
one whose counter stood still for a few seconds has died, been stopped (SIGSTOP, a hung
machine) or been cut off. Counters are compared only with this member's own clock, so
machines need not agree on the time. The heartbeat uses a store connection of its own
(`connect`): a long wait on another must not silence it, and a store that cannot be
reached is noted (`unreachable_for`) and connected to again.

The launchers name lost machines with it (dtrain.launch.nodes); live replicas drop a
silent peer with it (dtrain.ft.live).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import torch.distributed as dist


class Heartbeat:
    """Beats on this member's counter (`prefix + me`) and notes when each watched member's
    last moved.

    Args:
        connect: opens this heartbeat's own store connection; called again after the store
            failed. Any exception it raises counts as the store being out of reach.
        me: this member's name among the counters.
        period: seconds between beats.
        prefix: the keys' prefix in the store.
        members: the members watched from the start (more with `watch`).
        name: the thread's name.
    """

    def __init__(self, connect: Callable[[], dist.Store], me: str, period: float,
                 prefix: str = "", members: Iterable[str] = (),
                 name: str = "dtrain-heartbeat") -> None:
        self._connect, self._me, self._period, self._prefix = connect, me, period, prefix
        self._lock = threading.Lock()
        self._heard: dict[str, tuple[int, float]] = {}  # member -> (its count, when it moved)
        self._unreachable_since: float | None = None
        self._stopped = threading.Event()
        self.watch(members)
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def watch(self, members: Iterable[str]) -> None:
        """Watch `members` (and only them) from now: a member's silence counts from now or
        from when its counter last moved, whichever is later."""
        now = time.monotonic()
        with self._lock:
            self._heard = {m: (self._heard.get(m, (-1, now))[0], now)
                           for m in members if m != self._me}

    def silent_for(self, member: str) -> float:
        """Seconds since `member`'s counter last moved (or it was first watched); 0 for a
        member not watched."""
        with self._lock:
            heard = self._heard.get(member)
        return 0.0 if heard is None else time.monotonic() - heard[1]

    def moved_since(self, member: str, moment: float) -> bool:
        """Whether `member`'s counter moved after `moment` (time.monotonic())."""
        with self._lock:
            heard = self._heard.get(member)
        return heard is not None and heard[1] > moment

    def unreachable_for(self) -> float | None:
        """Seconds the store has been out of reach; None while it answers."""
        with self._lock:
            since = self._unreachable_since
        return None if since is None else time.monotonic() - since

    def stop(self) -> None:
        """Stop beating; waits a few periods for the thread (it may be inside a store call,
        which must not run on at interpreter exit), not for a connection that hangs."""
        self._stopped.set()
        self._thread.join(timeout=4 * self._period)

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                store = self._connect()
                while not self._stopped.is_set():
                    self._beat(store)
                    self._stopped.wait(self._period)
            except Exception:  # noqa: BLE001 - any failure of the store: it is out of reach
                with self._lock:
                    if self._unreachable_since is None:
                        self._unreachable_since = time.monotonic()
                self._stopped.wait(self._period)

    def _beat(self, store: dist.Store) -> None:
        store.add(self._prefix + self._me, 1)
        with self._lock:
            others = list(self._heard)
        counts = {m: store.add(self._prefix + m, 0) for m in others}
        now = time.monotonic()
        with self._lock:
            self._unreachable_since = None
            for member, count in counts.items():
                if member in self._heard and self._heard[member][0] != count:
                    self._heard[member] = (count, now)
