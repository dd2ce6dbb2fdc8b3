"""The live replicas' watchdog: a quorum's group is aborted as soon as one of its members
fails or its heartbeat (dtrain.store.heartbeat) stands still, so that the others, blocked in
a collective on it, fail at once instead of after the group's timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

import torch.distributed as dist


class Abortable(Protocol):
    """What the watchdog stops: a group whose `abort()` makes its collectives give up (the
    live replicas' LiveGroup)."""

    def abort(self) -> None: ...


class Watchdog:
    """Aborts the current quorum's group as soon as one of its members reports a failure
    (the key `r/{round}/failed`) or `silent_for(member)` (seconds its heartbeat, or any of
    its ranks' but this one's, stood still) passes `silent_after`, so that members blocked
    in a collective on it fail at once instead of after the group's timeout."""

    def __init__(self, store: dist.Store, silent_for: Callable[[int], float], me: str,
                 silent_after: float, period: float = 0.05) -> None:
        self._store, self._silent_for = store, silent_for
        self._silent_after, self._period = silent_after, period
        self._watched: tuple[int, list[int], Abortable] | None = None  # round, members, group
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"dtrain-live-watchdog-{me}")
        self._thread.start()

    def watch(self, round_: int, members: list[int], group: Abortable) -> None:
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
