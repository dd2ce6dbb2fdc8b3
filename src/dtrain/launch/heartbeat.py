"""Which machines of a job are still there: launchers beat on counters in node 0's store.

A lost machine (powered off, crashed, cut off the network) makes the ranks elsewhere fail
only as their collectives time out, with nothing that names the machine. The launcher's
heartbeat names it in the error line instead.
"""

from __future__ import annotations

import socket
import time

from dtrain.launch.watch import Watcher


class Heartbeat(Watcher):
    """Which other machines of a job are still there, asked once local ranks have failed.

    A lost machine (powered off, crashed, cut off the network) makes the ranks here fail
    only as their collectives time out, with nothing that names the machine. So with
    `--nnodes` > 1 each launcher beats, from a thread, on a counter of its own in the job's
    rendezvous store (node 0's), every `PERIOD_S`, and watches the others' counters. When
    local ranks fail, `lost()` names the nodes that have stopped beating: those silent for
    `GRACE_S`, waiting up to that long for a sign of life from each. A node that is not
    node 0 and cannot reach the store has lost node 0.
    """

    name = "dtrain-heartbeat"
    PERIOD_S = 0.5
    GRACE_S = 5.0
    STORE_TIMEOUT_S = 10.0

    def __init__(self, host: str, port: int, run_id: str, node_rank: int, nnodes: int,
                 nproc: int) -> None:
        import threading

        self._where = (host, port)
        self._prefix = f"dtrain/heartbeat/{run_id}/"
        self._node, self._nnodes, self._nproc = node_rank, nnodes, nproc
        self._lock = threading.Lock()
        self._heard: dict[int, tuple[int, float]] = {}  # node -> (its count, when it changed)
        self._nprocs: dict[int, int] = {node_rank: nproc}
        self._unreachable_since: float | None = None
        self.start()

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
                store.set(f"{self._prefix}nproc/{self._node}", str(self._nproc))
                while not self.stopped.is_set():
                    self._beat(store)
                    self.stopped.wait(self.PERIOD_S)
            except Exception:  # noqa: BLE001 - any failure of the store: it is out of reach
                with self._lock:
                    if self._unreachable_since is None:
                        self._unreachable_since = time.monotonic()
                self.stopped.wait(self.PERIOD_S)

    def _beat(self, store) -> None:
        """Count one beat of this node's; note when each other node's count last moved."""
        store.add(f"{self._prefix}alive/{self._node}", 1)
        now = time.monotonic()
        counts = {}
        for node in range(self._nnodes):
            if node != self._node:
                counts[node] = store.add(f"{self._prefix}alive/{node}", 0)
                key = f"{self._prefix}nproc/{node}"
                if node not in self._nprocs and store.check([key]):
                    self._nprocs[node] = int(store.get(key))
        with self._lock:
            self._unreachable_since = None
            for node, count in counts.items():
                if self._heard.get(node, (None,))[0] != count:
                    self._heard[node] = (count, now)

    def _ranks(self, node: int) -> str:
        if any(n not in self._nprocs for n in range(node + 1)):
            return ""
        first = sum(self._nprocs[n] for n in range(node))
        last = first + self._nprocs[node] - 1
        return f" (rank {first})" if first == last else f" (ranks {first}-{last})"

    def lost(self) -> str:
        """What was lost, as the head of an error line; empty when every node still beats."""
        since = time.monotonic()
        others = [n for n in range(self._nnodes) if n != self._node]
        while True:
            now = time.monotonic()
            with self._lock:
                unreachable = self._unreachable_since
                heard = dict(self._heard)
            if unreachable is not None and self._node == 0:
                return ""  # its own store is gone: the job is over, nothing to tell
            if unreachable is not None:
                host, port = self._where
                return (f"lost node 0{self._ranks(0)}: its store at {host}:{port} cannot be "
                        "reached (the machine is down, the network to it is cut, or its "
                        "launcher has ended: see its output)")
            alive = [n for n in others if n in heard and heard[n][1] > since]
            silent = [n for n in others if n not in alive
                      and now - heard.get(n, (0, since))[1] >= self.GRACE_S]
            if len(alive) + len(silent) == len(others):
                break
            time.sleep(0.1)
        if not silent:
            return ""
        quiet = max(now - heard.get(n, (0, since))[1] for n in silent)
        names = ", ".join(f"node {n}{self._ranks(n)}" for n in silent)
        its = "its launcher" if len(silent) == 1 else "their launchers"
        return (f"lost {names}: no heartbeat from {its} for {quiet:.0f}s (the machine is down "
                "or the network to it is cut)")
