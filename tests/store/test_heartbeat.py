"""Heartbeats (dtrain.store.heartbeat): a member that stops beating falls silent; a store
that stalls every member alike silences no one."""

from __future__ import annotations

import threading
import time

import pytest

from dtrain.store.heartbeat import STALE_PERIODS, Heartbeat

PERIOD = 0.05


class StallingStore:
    """A store's `add` in memory, that can be made to wait (a stalled store: an etcd
    election, an overloaded server) until `resume()`."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._open = threading.Event()
        self._open.set()

    def add(self, key: str, amount: int) -> int:
        self._open.wait()
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + amount
            return self._counts[key]

    def stall(self) -> None:
        self._open.clear()

    def resume(self) -> None:
        self._open.set()


def pair(store: StallingStore) -> tuple[Heartbeat, Heartbeat]:
    a = Heartbeat(lambda: store, "a", PERIOD, members=["b"])  # type: ignore[arg-type, return-value]
    b = Heartbeat(lambda: store, "b", PERIOD, members=["a"])  # type: ignore[arg-type, return-value]
    return a, b


@pytest.mark.timeout(30)
def test_a_member_that_stops_beating_falls_silent() -> None:
    store = StallingStore()
    a, b = pair(store)
    try:
        time.sleep(10 * PERIOD)
        assert a.silent_for("b") < 3 * PERIOD
        b.stop()
        time.sleep(20 * PERIOD)
        assert a.silent_for("b") >= 15 * PERIOD  # seen standing still by a's reads
        assert a.silent_for("nobody") == 0.0
    finally:
        a.stop()
        b.stop()


@pytest.mark.timeout(30)
def test_a_stalled_store_silences_no_one() -> None:
    """Every call waits 40 periods (both members' beats and reads): neither counts more
    than STALE_PERIODS periods of it as the other's silence, and once the store answers
    again each is heard at once."""
    store = StallingStore()
    a, b = pair(store)
    try:
        time.sleep(10 * PERIOD)
        store.stall()
        time.sleep(40 * PERIOD)
        bound = (STALE_PERIODS + 2) * PERIOD  # the stale stretch, and a period or two
        assert a.silent_for("b") <= bound and b.silent_for("a") <= bound
        store.resume()
        time.sleep(6 * PERIOD)
        assert a.silent_for("b") < 3 * PERIOD and b.silent_for("a") < 3 * PERIOD
    finally:
        store.resume()
        a.stop()
        b.stop()


@pytest.mark.timeout(30)
def test_a_member_heard_by_other_means_is_not_silent_until_the_next_read() -> None:
    """A member silent for long and heard from by other means (a live replica's arrival in
    a round) is silent from that moment, not from its counter's last read: the member
    that joined a live quorum is not dropped at the next round for a silence it ended."""
    store = StallingStore()
    a = Heartbeat(lambda: store, "a", 1000.0, members=["b"])  # type: ignore[arg-type, return-value]
    try:
        time.sleep(0.3)  # a read once, at start: b is silent from then, not read again
        assert a.silent_for("b") >= 0.25
        a.heard(["b", "nobody"])
        assert a.silent_for("b") < 0.05 and a.silent_for("nobody") == 0.0
    finally:
        a.stop()
