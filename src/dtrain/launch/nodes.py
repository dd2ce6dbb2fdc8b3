"""Which machines of a job are still there: each launcher beats on a counter in the job's
store (node 0's, or the etcd cluster), and names the machines whose counters stood still.

A lost machine (powered off, crashed, cut off the network) makes the ranks elsewhere fail
only as their collectives time out, with nothing that names the machine, and only after
that timeout (minutes). The launchers' heartbeat (dtrain.store.heartbeat) notices it within
seconds instead, and this module names it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import torch.distributed as dist

from dtrain.errors import LaunchError
from dtrain.store import StoreAddress
from dtrain.store.heartbeat import Heartbeat


def node_name(index: int, first: int, nproc: int) -> str:
    """A machine of a job as the launchers' lines name it: its node rank and its ranks."""
    last = first + nproc - 1
    return f"node {index} (rank {first})" if nproc == 1 else \
        f"node {index} (ranks {first}-{last})"


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

    def __init__(self, address: StoreAddress, run_id: str, node_id: str) -> None:
        self._address = address
        self._me = node_id
        self._members: list[tuple[str, int]] = []  # (node id, ranks) by node rank
        self._beat = Heartbeat(self._connect, node_id, self.PERIOD_S,
                               prefix=f"dtrain/heartbeat/{run_id}/")

    def _connect(self) -> dist.Store:
        if self._address.backend == "c10d":
            # Quietly until node 0 listens: the store's client logs every failed try.
            where = (self._address.host, self._address.port)
            with socket.create_connection(where, timeout=self.STORE_TIMEOUT_S):
                pass
        return self._address.connect(self.STORE_TIMEOUT_S)

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
        return node_name(index, sum(ranks[:index]), ranks[index])

    def _store_lost(self) -> str:
        if self._address.backend == "etcd":
            return (f"lost {self._address.describe()}: no member answers (they are down, the "
                    "network to them is cut, or the cluster lost its quorum)")
        hosting = self._name(self._members[0][0]) if self._members else "node 0"
        return (f"lost {hosting}: its store at {self._address.host}:{self._address.port} cannot "
                "be reached (the machine is down, the network to it is cut, or its launcher "
                "has ended: see its output)")

    def _hosting(self) -> bool:
        return (self._address.backend == "c10d" and bool(self._members)
                and self._members[0][0] == self._me)

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
        quiet = self._settle()
        if quiet is None:
            return "" if self._hosting() else self._store_lost()  # hosting: the job is over
        return self._describe(quiet)

    def _settle(self) -> dict[str, float] | None:
        """The members silent for `GRACE_S`, and for how long, once each other member has
        either beaten or gone silent that long; None when the store is out of reach."""
        since = time.monotonic()
        while True:
            if self._beat.unreachable_for() is not None:
                return None
            others = self._others()
            alive = [n for n in others if self._beat.moved_since(n, since)]
            quiet = {n: self._beat.silent_for(n) for n in others if n not in alive}
            quiet = {n: s for n, s in quiet.items() if s >= self.GRACE_S}
            if len(alive) + len(quiet) == len(others):
                return quiet
            time.sleep(0.1)

    def take_a_lost_place(self, members: list[tuple[str, int]], timeout: float,
                          claim: Callable[[int, str], bool]) -> int:
        """The node rank of a member of `members` that has stopped beating and that
        `claim(node rank, its node id)` won for this launcher, waiting up to `timeout`.

        Raises:
            LaunchError: none was lost (or every lost place was claimed by another) in time.
        """
        deadline = time.monotonic() + timeout
        while True:
            self.watch(members)
            quiet = self._settle() or {}
            for rank, (node, _) in enumerate(members):
                if node in quiet and claim(rank, node):
                    return rank
            if time.monotonic() > deadline:
                raise LaunchError(f"the running live job lost no machine in {timeout:.0f}s: "
                                  "a late launcher takes the place of a lost one (all "
                                  f"{len(members)} still beat)")

    def _describe(self, quiet: dict[str, float]) -> str:
        if not quiet:
            return ""
        names = ", ".join(self._name(node) for node in quiet)
        its = "its launcher" if len(quiet) == 1 else "their launchers"
        return (f"lost {names}: no heartbeat from {its} for {max(quiet.values()):.0f}s (the "
                "machine is down or the network to it is cut)")
