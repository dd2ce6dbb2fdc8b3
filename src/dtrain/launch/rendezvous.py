"""The job's rendezvous: torch's dynamic rendezvous (torchrun's `c10d` engine, with rounds),
its store listening on the master's address only.

One launcher hosts the store every node meets in (`--master HOST:PORT`): the one started
with `--node-rank 0`, or, without it, the first that can listen there. torch would let that
store listen on every interface of the machine, so anyone who can reach it could write into
a job; dtrain opens the listening socket itself, bound to the master's address only
(127.0.0.1 for a one-machine job; there the kernel picks a free port), and hands it over.

With `--rdzv-backend etcd` the store is an etcd cluster instead (dtrain.store.etcd), and no
launcher hosts anything: the rounds' state is kept by torch's own etcd backend on the same
cluster, and every other key by dtrain's etcd store.

On that store torch's dynamic rendezvous runs rounds: a round admits between `min_nodes`
and `max_nodes` launchers (after `min_nodes` have come it waits `last_call` seconds more for
others), numbers them by address, and closes. A node that joins later waits for the next
round, and the agents of a round restart their ranks to admit it; a node that leaves stops
beating (torch's keep-alive, every `KEEP_ALIVE_S`) and is dropped from the next round. The
ranks of each round meet in keys of that round only (DTRAIN_ATTEMPT), so nothing a previous
round left in the store can mislead them.
"""

from __future__ import annotations

import errno
import inspect
import json
import os
import socket
import threading
import uuid
from datetime import timedelta

import torch.distributed as dist

from dtrain import env
from dtrain.errors import LaunchError
from dtrain.launch.nodes import NodeWatch, node_name
from dtrain.store import StoreAddress, prefixed

KEEP_ALIVE_S = 1  # torch's rendezvous keep-alive; a node silent for 3 of them is dropped
STORE_TIMEOUT_S = 30.0
LIVE_JOB = "dtrain/live-job"  # set once a live job's round has formed: its attempt and nodes
LIVE_PLACE = "dtrain/live-place/"  # + attempt/node rank: the node id holding that place


def listen(host: str, port: int) -> tuple[int, int]:
    """Listen on `host`:`port` (port 0: any free one) for the store: (file descriptor, port).
    The descriptor is the store's to close.

    Raises:
        LaunchError: the port is in use, or `host` is not an address of this machine.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise LaunchError(f"port {port} on {host} is in use: pass --master "
                              f"{host}:<free port>") from None
        raise LaunchError(f"node 0 cannot listen on --master {host}:{port} ({exc.strerror or exc})"
                          ": give an address of this machine") from None
    bound = sock.getsockname()[1]
    return sock.detach(), bound


def try_listen(host: str, port: int) -> int | None:
    """The store's socket if this launcher can host it at `host`:`port`; None when another
    process already listens there or the address is not this machine's."""
    try:
        return listen(host, port)[0]
    except LaunchError:
        return None


def local_address(host: str, port: int) -> str:
    """This machine's address on the route to `host` (how the rendezvous orders nodes:
    hosts sharing a hostname, as containers and namespaces do, still sort by address)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                           socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))  # a datagram socket sends nothing to connect
            return probe.getsockname()[0]
    except OSError:
        return socket.getfqdn()


def node_id(host: str, port: int) -> str:
    """A name for this launcher, unique in the job (its address, pid and a random tag)."""
    return f"{local_address(host, port)}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def open_store(address: StoreAddress, listen_fd: int | None, timeout_s: float) -> dist.Store:
    """The job's store: served here on `listen_fd`, else a client of `address` (an etcd
    cluster is first asked whether any member answers, for up to `timeout_s`)."""
    timeout = timedelta(seconds=timeout_s)
    if address.backend == "etcd":
        from dtrain.store.etcd import Cluster

        Cluster(address.endpoints, timeout_s).check(timeout_s)
        return address.connect(timeout_s)
    if listen_fd is not None:
        return dist.TCPStore(address.host, address.port, None, True, timeout, multi_tenant=True,
                             master_listen_fd=listen_fd, wait_for_workers=False)
    return dist.TCPStore(address.host, address.port, None, False, timeout)


def _backend(address: StoreAddress, store: dist.Store, run_id: str):
    """torch's rendezvous backend for the store: its c10d backend on the job's store, or
    its etcd backend on the same etcd cluster (through dtrain's failover client)."""
    if address.backend != "etcd":
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
            C10dRendezvousBackend,
        )

        return C10dRendezvousBackend(store, run_id)
    from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import (
        EtcdRendezvousBackend,
    )

    from dtrain.store.etcd import Cluster

    return EtcdRendezvousBackend(Cluster(address.endpoints, STORE_TIMEOUT_S), run_id,
                                 key_prefix="/dtrain/rendezvous")


def _method_name(depth: int = 2) -> str:
    """The name of the function `depth` frames up, as torch's rendezvous names its events,
    read from the frames alone."""
    frame = inspect.currentframe()
    for _ in range(depth):
        frame = frame.f_back if frame is not None else None
    return frame.f_code.co_name if frame is not None else "no_method_name"


def _name_events_cheaply() -> None:
    """torch's dynamic rendezvous names every event it records by its caller's name, found
    with two calls of inspect.stack(), which reads the source lines of every frame: a
    second or more of the launcher's start-up (measured in docs/development.md), even when
    nothing records the events. The same name comes from the frames alone."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    dynamic_rendezvous.get_method_name = _method_name


class Rendezvous:
    """torch's DynamicRendezvousHandler for the agent, with what dtrain adds:

    - the ranks bootstrap from the job's own store (the master's address, never a port
      guessed elsewhere), under keys of the round (DTRAIN_ATTEMPT);
    - each round's members and their rank counts are known (`members`), for the heartbeat;
    - nodes are numbered by `order` (the node rank asked for; the store's host asks for 0),
      then by address;
    - `membership_changed()` makes the agent restart its ranks for a new round without
      spending a restart, as torch does when a node is waiting: for a node that left;
    - with `live`, one round for the whole job, which a late launcher enters in the place
      of a lost one (the module's docstring).
    """

    def __init__(self, store: dist.Store, address: StoreAddress, run_id: str, node_id: str,
                 min_nodes: int, max_nodes: int, join_timeout: float, last_call: float,
                 nproc: int, order: int | None = None, beat: NodeWatch | None = None,
                 live: bool = False) -> None:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            DynamicRendezvousHandler,
            RendezvousTimeout,
        )

        _name_events_cheaply()
        self.store, self.address, self.nproc = store, address, nproc
        self.host, self.port = address.first()
        self.node_id, self.live, self.join_timeout = node_id, live, join_timeout
        self._round_store: dist.Store | None = None  # the round's keys, for refresh_members
        # torch's shared worker store would listen on every interface: dtrain's is the job's
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        self.inner = DynamicRendezvousHandler.from_backend(
            run_id, store, _backend(address, store, run_id), min_nodes, max_nodes,
            local_addr=(f"{999999 if order is None else order:06d}/"
                        f"{local_address(self.host, self.port)}"),
            timeout=RendezvousTimeout(join=timedelta(seconds=join_timeout),
                                      last_call=timedelta(seconds=last_call),
                                      close=timedelta(seconds=10)),
            keep_alive_interval=KEEP_ALIVE_S, keep_alive_max_attempt=3)
        self.members: list[tuple[str, int]] = []  # (node id, ranks) of the round, by node rank
        self.rounds = 0  # rounds this launcher took part in
        self.node_rank = 0  # this launcher's node rank, and its first rank, in the last round
        self.first_rank = 0
        self.beat = beat  # watches the round's members (after each round)
        self._changed = threading.Event()

    # --- torch's RendezvousHandler interface, as the agent calls it
    def get_backend(self) -> str:
        return self.address.backend

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self):
        if self.live and self.rounds == 0 and self.store.check([LIVE_JOB]):
            return self._replace()
        info = self.inner.next_rendezvous()
        self._changed.clear()
        if info.rank == 0:  # the job's rounds so far, counted in the store (not the round's)
            count = self.store.add("dtrain/rounds", 1)
            info.store.set("dtrain/attempt", f"{count}-{uuid.uuid4().hex[:8]}")
        attempt = info.store.get("dtrain/attempt").decode()
        round_store = prefixed(f"dtrain/round/{attempt}/", self.store)
        round_store.set(f"dtrain/member/{info.rank}", f"{self.node_id} {self.nproc}")
        said = [round_store.get(f"dtrain/member/{r}").decode().split()
                for r in range(info.world_size)]
        if self.live:
            self._keep_one_round(attempt, info.rank, said)
        return self._entered(round_store, attempt, info.rank, said)

    def _entered(self, round_store: dist.Store, attempt: str, node_rank: int,
                 said: list[list[str]]):
        """The round `attempt` entered as `node_rank`, its members as `said`, for the agent."""
        from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

        env.ATTEMPT.set(attempt)
        env.ROUND.set(attempt.partition("-")[0])
        self._round_store = round_store
        self.members = [(node, int(n)) for node, n in said]
        self.rounds += 1
        self.node_rank = node_rank
        self.first_rank = sum(n for _, n in self.members[:node_rank])
        if self.beat is not None:
            self.beat.watch(self.members)
        return RendezvousInfo(round_store, node_rank, len(said),
                              RendezvousStoreInfo(self.host, self.port))

    def _keep_one_round(self, attempt: str, node_rank: int, said: list[list[str]]) -> None:
        """Live replicas: every node of the round runs as many ranks (a replacement takes a
        node's ranks as they were); the round's node 0 says the job has formed, and each
        node owns its place."""
        counts = {int(n) for _, n in said}
        if len(counts) > 1:
            raise LaunchError("live replicas need the same -n on every machine (a machine's "
                              f"replacement takes its ranks as they were); got {sorted(counts)}")
        os.environ["TORCH_ELASTIC_WORKER_IDENTICAL"] = "1"  # ranks by node rank, no gathering
        self.store.set(f"{LIVE_PLACE}{attempt}/{node_rank}", self.node_id)
        if node_rank == 0:
            self.store.set(LIVE_JOB, json.dumps({"attempt": attempt, "nodes": len(said)}))

    def _replace(self):
        """Enter a running live job in the place of a node whose heartbeat has stopped,
        waiting up to `join_timeout` for one: its node rank, its ranks, and a new
        generation of each replica they held (dtrain.launch.supervisor).

        Raises:
            LaunchError: no node was lost within `join_timeout`.
        """
        from dtrain.launch.supervisor import next_generation

        job = json.loads(self.store.get(LIVE_JOB))
        attempt, nodes = job["attempt"], job["nodes"]
        round_store = prefixed(f"dtrain/round/{attempt}/", self.store)
        said = [round_store.get(f"dtrain/member/{r}").decode().split() for r in range(nodes)]
        if self.beat is None:
            raise LaunchError("a running live job has no place for a launcher of one machine")
        if self.nproc != int(said[0][1]):
            raise LaunchError(f"-n {self.nproc}: this live job's machines run {said[0][1]} rank(s) "
                              "each, and a replacement takes a lost one's ranks as they were")
        taken = self.beat.take_a_lost_place(
            [(node, int(n)) for node, n in said], self.join_timeout,
            lambda r, lost: self.store.compare_set(f"{LIVE_PLACE}{attempt}/{r}", lost,
                                                   self.node_id).decode() == self.node_id)
        os.environ["TORCH_ELASTIC_WORKER_IDENTICAL"] = "1"
        said[taken] = [self.node_id, str(self.nproc)]
        round_store.set(f"dtrain/member/{taken}", f"{self.node_id} {self.nproc}")
        ranks = env.LIVE_RANKS.get()
        first = taken * self.nproc
        for replica in sorted({r // ranks for r in range(first, first + self.nproc)}):
            next_generation(self.store, replica)
        print(f"dtrain: took the place of lost {node_name(taken, first, self.nproc)} in the "
              "running live job; its replicas recover from a live peer", flush=True)
        return self._entered(round_store, attempt, taken, said)

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self) -> None:
        self.inner.set_closed()

    def num_nodes_waiting(self) -> int:
        if self.live:  # one round for the whole job: a late launcher takes a lost place
            return 0
        try:
            waiting = self.inner.num_nodes_waiting()
        except Exception:  # noqa: BLE001 - the store is out of reach: the heartbeat tells
            waiting = 0
        return waiting + (1 if self._changed.is_set() else 0)

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        try:
            return self.inner.shutdown()
        except Exception:  # noqa: BLE001 - the store is gone with its host: nothing to close
            return False

    # --- dtrain's
    def refresh_members(self) -> None:
        """Read the round's members again and watch the new ones: in a live job a launcher
        that took a lost place is a member from then on."""
        if self._round_store is None:
            return
        said = [self._round_store.get(f"dtrain/member/{r}").decode().split()
                for r in range(len(self.members))]
        members = [(node, int(n)) for node, n in said]
        if members != self.members:
            self.members = members
            if self.beat is not None:
                self.beat.watch(members)

    def membership_changed(self) -> None:
        """A node of the round has left: the agent starts a new round at its next check."""
        self._changed.set()
