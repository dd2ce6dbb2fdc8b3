"""Which machines of a job are still there: each launcher beats on a counter in the job's
store (node 0's), and names the machines whose counters stood still.

A lost machine (powered off, crashed, cut off the network) makes the ranks elsewhere fail
only as their collectives time out, with nothing that names the machine, and only after
that timeout (minutes). The launchers' heartbeat (dtrain.ft.heartbeat) notices it within
seconds instead, and this module names it.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

from dtrain.ft.heartbeat import Heartbeat


class NodeWatch:
    """Which other machines of the current round are still there.

    Each launcher beats, from a thread, on a counter of its own in the job's store every
    `PERIOD_S`, and watches the counters of the round's other members (`watch`, after each
    rendezvous round). `silent()` names members that have not beaten for `GRACE_S` (the
    launcher then stops waiting for its ranks' collectives to time out); `lost()`, asked
    once local ranks have failed, waits up to `GRACE_S` for a sign of life from each member
    and names those that gave none. A launcher that cannot reach the store has lost the
    node hosting it.
    """

    PERIOD_S = 0.5
    GRACE_S = 5.0
    STORE_TIMEOUT_S = 10.0

    def __init__(self, host: str, port: int, run_id: str, node_id: str) -> None:
        self._where = (host, port)
        self._me = node_id
        self._members: list[tuple[str, int]] = []  # (node id, ranks) by node rank
        self._beat = Heartbeat(self._connect, node_id, self.PERIOD_S,
                               prefix=f"dtrain/heartbeat/{run_id}/")

    def _connect(self):
        from torch.distributed import TCPStore

        # Quietly until node 0 listens: the store's client logs every failed try.
        with socket.create_connection(self._where, timeout=self.STORE_TIMEOUT_S):
            pass
        return TCPStore(*self._where, is_master=False,
                        timeout=timedelta(seconds=self.STORE_TIMEOUT_S))

    def watch(self, members: list[tuple[str, int]]) -> None:
        """The members of the round just formed (by node rank), this launcher among them:
        each is alive as its round starts, so its silence counts from now."""
        self._members = list(members)
        self._beat.watch(node for node, _ in members)

    def stop(self) -> None:
        self._beat.stop()

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

    def _hosting(self) -> bool:
        return bool(self._members) and self._members[0][0] == self._me

    def _others(self) -> list[str]:
        return [node for node, _ in self._members if node != self._me]

    @property
    def store_lost(self) -> bool:
        """Whether the store (with the node hosting it) is out of reach now."""
        return self._beat.unreachable_for() is not None

    def silent(self) -> str:
        """What was lost, as the head of an error line, if a member has been silent for
        `GRACE_S` (or the store out of reach as long) now; empty otherwise."""
        unreachable = self._beat.unreachable_for()
        if unreachable is not None:
            return "" if self._hosting() or unreachable < self.GRACE_S else self._store_lost()
        quiet = {node: self._beat.silent_for(node) for node in self._others()}
        return self._describe({n: s for n, s in quiet.items() if s >= self.GRACE_S})

    def lost(self) -> str:
        """What was lost, as the head of an error line; empty when every member still beats
        (waits up to `GRACE_S` for each to show it is alive or has gone silent)."""
        since = time.monotonic()
        while True:
            if self._beat.unreachable_for() is not None:
                return "" if self._hosting() else self._store_lost()  # hosting: the job is over
            others = self._others()
            alive = [n for n in others if self._beat.moved_since(n, since)]
            quiet = {n: self._beat.silent_for(n) for n in others if n not in alive}
            quiet = {n: s for n, s in quiet.items() if s >= self.GRACE_S}
            if len(alive) + len(quiet) == len(others):
                return self._describe(quiet)
            time.sleep(0.1)

    def _describe(self, quiet: dict[str, float]) -> str:
        if not quiet:
            return ""
        names = ", ".join(self._name(node) for node in quiet)
        its = "its launcher" if len(quiet) == 1 else "their launchers"
        return (f"lost {names}: no heartbeat from {its} for {max(quiet.values()):.0f}s (the "
                "machine is down or the network to it is cut)")
