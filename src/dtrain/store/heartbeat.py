"""Heartbeats: who is still running, noticed in seconds instead of at a collective's
timeout.

Each member of a group (a launcher of a multi-machine job, a rank of a live replica)
bumps a counter of its own in a store every `period` from a thread, and reads the others';
one whose counter stood still for a few seconds has died, been stopped (SIGSTOP, a hung
machine) or been cut off. Counters are compared only with this member's own clock, so
machines need not agree on the time. The heartbeat uses a store connection of its own
(`connect`): a long wait on another must not silence it, and a store that cannot be
reached is noted (`unreachable_for`) and connected to again.

A member's silence is what this member saw of it: the time over which its own reads of
the store found the other's counter standing still. While its own reads do not come back
(the store electing a new etcd leader, or slowed down), it sees nothing, so it counts
at most two periods of that wait (STALE_PERIODS) as anyone's silence: a store that
stalls every member alike silences no one, while a member that stopped beating, read by
one that reads, is silent from its last beat.

The launchers name lost machines with it (dtrain.launch.nodes); live replicas drop a
silent peer with it (dtrain.ft.live).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch.distributed as dist

STALE_PERIODS = 2
"""How many periods of a wait for this member's own reads count as the others' silence."""


@dataclass
class _Heard:
    """What this member saw of another: its counter, the silence seen since it last moved
    (seconds up to the last read; negative at first: counted from when it was watched),
    and when it last moved (time.monotonic())."""

    count: int
    quiet: float
    moved: float


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
        self._heard: dict[str, _Heard] = {}
        self._read: float = time.monotonic()  # this member's last read of the counters
        self._unreachable_since: float | None = None
        self._stopped = threading.Event()
        self.watch(members)
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def watch(self, members: Iterable[str]) -> None:
        """Watch `members` (and only them) from now: a member's silence counts from now or
        from when its counter last moved, whichever is later."""
        with self._lock:
            self._heard = {m: self._heard.get(m, _Heard(-1, 0.0, 0.0))
                           for m in members if m != self._me}
            watched = list(self._heard)
        self.heard(watched)

    def heard(self, members: Iterable[str]) -> None:
        """Note that `members` (those watched) gave a sign of life now by other means (a
        post in the store): their silence counts from now, as if their counters moved.
        Without it a member that was silent long and just came back could be read as
        silent until this member's next read of its counter."""
        now = time.monotonic()
        with self._lock:
            since_read = self._since_read(now)
            for member in members:
                heard = self._heard.get(member)
                if heard is not None:
                    heard.quiet, heard.moved = -since_read, now

    def silent_for(self, member: str) -> float:
        """Seconds this member's reads have seen `member`'s counter stand still since it
        last moved (or it was first watched), and since the last read (at most
        STALE_PERIODS periods of it); 0 for a member not watched."""
        with self._lock:
            heard = self._heard.get(member)
            return 0.0 if heard is None else \
                max(0.0, heard.quiet + self._since_read(time.monotonic()))

    def moved_since(self, member: str, moment: float) -> bool:
        """Whether `member`'s counter moved after `moment` (time.monotonic())."""
        with self._lock:
            heard = self._heard.get(member)
        return heard is not None and heard.moved > moment

    def _since_read(self, now: float) -> float:
        """The time since the last read that counts as silence (under the lock)."""
        return min(now - self._read, STALE_PERIODS * self._period)

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
            seen = self._since_read(now)  # the stretch this read vouches for
            self._read = now
            for member, count in counts.items():
                heard = self._heard.get(member)
                if heard is None:
                    continue
                if heard.count != count:
                    heard.count, heard.quiet, heard.moved = count, 0.0, now
                else:
                    heard.quiet += seen
