"""Which machines of a job are still there: launchers beat on counters in the job's store.

A lost machine (powered off, crashed, cut off the network) makes the ranks elsewhere fail
only as their collectives time out, with nothing that names the machine, and only after
that timeout (minutes). The launchers' heartbeat notices it within seconds instead, and
names it.
"""

from __future__ import annotations

import socket
import time

from dtrain.launch.watch import Watcher


class Heartbeat(Watcher):
    """Which other machines of the current round are still there.

    Each launcher beats, from a thread, on a counter of its own in the job's store (node
    0's) every `PERIOD_S`, and watches the counters of the round's other members (`watch`,
    after each rendezvous round). `silent()` names members that have not beaten for
    `GRACE_S` (the launcher then stops waiting for its ranks' collectives to time out);
    `lost()`, asked once local ranks have failed, waits up to `GRACE_S` for a sign of life
    from each member and names those that gave none. A launcher that cannot reach the store
    has lost the node hosting it.
    """

    name = "dtrain-heartbeat"
    PERIOD_S = 0.5
    GRACE_S = 5.0
    STORE_TIMEOUT_S = 10.0

    def __init__(self, host: str, port: int, run_id: str, node_id: str) -> None:
        import threading

        self._where = (host, port)
        self._prefix = f"dtrain/heartbeat/{run_id}/"
        self._me = node_id
        self._lock = threading.Lock()
        self._members: list[tuple[str, int]] = []  # (node id, ranks) by node rank
        self._heard: dict[str, tuple[int, float]] = {}  # node id -> (its count, when it moved)
        self._unreachable_since: float | None = None
        self.start()

    def watch(self, members: list[tuple[str, int]]) -> None:
        """The members of the round just formed (by node rank), this launcher among them."""
        now = time.monotonic()
        with self._lock:
            self._members = list(members)
            # a member is alive when its round starts: its silence counts from now
            self._heard = {node: (self._heard.get(node, (-1, now))[0], now)
                           for node, _ in members}

    def _run(self) -> None:
        from datetime import timedelta

        from torch.distributed import TCPStore

        while not self.stopped.is_set():
            try:
                # Quietly until node 0 listens: the store's client logs every failed try.
                with socket.create_connection(self._where, timeout=self.STORE_TIMEOUT_S):
                    pass
                store = TCPStore(*self._where, is_master=False,
                                 timeout=timedelta(seconds=self.STORE_TIMEOUT_S))
                while not self.stopped.is_set():
                    self._beat(store)
                    self.stopped.wait(self.PERIOD_S)
            except Exception:  # noqa: BLE001 - any failure of the store: it is out of reach
                with self._lock:
                    if self._unreachable_since is None:
                        self._unreachable_since = time.monotonic()
                self.stopped.wait(self.PERIOD_S)

    def _beat(self, store) -> None:
        """Count one beat of this node's; note when each other member's count last moved."""
        store.add(f"{self._prefix}{self._me}", 1)
        with self._lock:
            others = [node for node, _ in self._members if node != self._me]
        counts = {node: store.add(f"{self._prefix}{node}", 0) for node in others}
        now = time.monotonic()
        with self._lock:
            self._unreachable_since = None
            for node, count in counts.items():
                if node in self._heard and self._heard[node][0] != count:
                    self._heard[node] = (count, now)

    def _name(self, node: str) -> str:
        ranks = [n for _, n in self._members]
        index = [m for m, _ in self._members].index(node)
        first, last = sum(ranks[:index]), sum(ranks[:index + 1]) - 1
        return f"node {index} (rank {first})" if first == last else \
            f"node {index} (ranks {first}-{last})"

    def _store_lost(self) -> str:
        host, port = self._where
        hosting = self._name(self._members[0][0]) if self._members else "node 0"
        return (f"lost {hosting}: its store at {host}:{port} cannot be reached (the machine is "
                "down, the network to it is cut, or its launcher has ended: see its output)")

    @property
    def store_lost(self) -> bool:
        """Whether the store (with the node hosting it) is out of reach now."""
        with self._lock:
            return self._unreachable_since is not None

    def silent(self) -> str:
        """What was lost, as the head of an error line, if a member has been silent for
        `GRACE_S` (or the store out of reach as long) now; empty otherwise."""
        now = time.monotonic()
        with self._lock:
            if self._unreachable_since is not None:
                hosting = self._members and self._members[0][0] == self._me
                return "" if hosting or now - self._unreachable_since < self.GRACE_S \
                    else self._store_lost()
            quiet = {node: now - when for node, (_, when) in self._heard.items()
                     if node != self._me and now - when >= self.GRACE_S}
            return self._describe(quiet)

    def lost(self) -> str:
        """What was lost, as the head of an error line; empty when every member still beats
        (waits up to `GRACE_S` for each to show it is alive or has gone silent)."""
        since = time.monotonic()
        while True:
            now = time.monotonic()
            with self._lock:
                unreachable = self._unreachable_since
                heard = dict(self._heard)
                hosting = bool(self._members) and self._members[0][0] == self._me
            if unreachable is not None:
                return "" if hosting else self._store_lost()  # hosting: the job is over
            others = [node for node in heard if node != self._me]
            alive = [n for n in others if heard[n][1] > since]
            quiet = {n: now - heard[n][1] for n in others
                     if n not in alive and now - heard[n][1] >= self.GRACE_S}
            if len(alive) + len(quiet) == len(others):
                with self._lock:
                    return self._describe(quiet)
            time.sleep(0.1)

    def _describe(self, quiet: dict[str, float]) -> str:
        if not quiet:
            return ""
        names = ", ".join(self._name(node) for node in quiet)
        its = "its launcher" if len(quiet) == 1 else "their launchers"
        return (f"lost {names}: no heartbeat from {its} for {max(quiet.values()):.0f}s (the "
                "machine is down or the network to it is cut)")
