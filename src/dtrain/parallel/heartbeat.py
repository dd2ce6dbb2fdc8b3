"""Heartbeats of live replicas: who is still running, without waiting for a timeout.

Each replica bumps a counter in the job's store (`hb/{id}`) every half second from a
thread, and reads everyone else's; a replica whose counter stood still for a few seconds
has died or been stopped (SIGSTOP, a hung machine). Counters are compared only with this
replica's own clock, so machines need not agree on the time. It uses its own store
connection: a long wait on another must not silence it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


class Heartbeat:
    """Bumps this replica's counter every `period` and notes when each other's last moved
    (on its own store connection: a wait on the main one must not silence it)."""

    def __init__(self, store: dist.Store, me: int, slots: int, period: float) -> None:
        self._store, self._me, self._slots, self._period = store, me, slots, period
        self._changed: dict[int, tuple[int, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"dtrain-live-heartbeat-{me}")
        self._thread.start()

    def _beat(self) -> None:
        self._store.add(f"hb/{self._me}", 1)
        now = time.monotonic()
        for other in range(self._slots):
            if other != self._me:
                value = self._store.add(f"hb/{other}", 0)
                with self._lock:
                    last = self._changed.get(other)
                    if last is None or last[0] != value:
                        self._changed[other] = (value, now)

    def _loop(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self._beat()
            except (RuntimeError, dist.DistError):
                return  # the store is gone: the job is coming down

    def silent_for(self, replica: int) -> float:
        """Seconds since `replica`'s heartbeat last moved (since first looked at)."""
        with self._lock:
            last = self._changed.get(replica)
        return 0.0 if last is None else time.monotonic() - last[1]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class Watchdog:
    """Aborts the current quorum's group as soon as one of its members reports a failure
    (the key `r/{round}/failed`) or `silent_for(member)` (seconds its heartbeat, or any of
    its ranks' but this one's, stood still) passes `silent_after`, so that members blocked
    in a collective on it fail at once instead of after the group's timeout."""

    def __init__(self, store: dist.Store, silent_for: Callable[[int], float], me: str,
                 silent_after: float, period: float = 0.05) -> None:
        self._store, self._silent_for = store, silent_for
        self._silent_after, self._period = silent_after, period
        self._watched: tuple[int, list[int], Any] | None = None  # round, members, group
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"dtrain-live-watchdog-{me}")
        self._thread.start()

    def watch(self, round_: int, members: list[int], group: Any) -> None:
        """Watch `group` (anything with `abort()`), the group of round `round_`'s quorum."""
        self._watched = (round_, members, group)

    def _loop(self) -> None:
        while not self._stop.wait(self._period):
            watched = self._watched
            if watched is None:
                continue
            round_, members, group = watched
            try:
                failed = self._store.check([f"r/{round_}/failed"])
            except (RuntimeError, dist.DistError):
                return  # the store is gone: the job is coming down
            if failed or any(self._silent_for(m) > self._silent_after for m in members):
                self._watched = None
                group.abort()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
