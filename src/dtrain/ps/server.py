"""A parameter server: one shard of the flat parameter vector, its optimizer, the clocks.

Workers push gradients and pull parameters (dtrain.ps.worker). What a pull waits for is
the consistency model (Li et al., OSDI 2014; Ho et al., NIPS 2013):

    sync   the average of every live worker's gradient for step t is applied once all
           have arrived; a pull for step t+1 is answered after that (synchronous data
           parallelism, with the optimizer on the servers)
    async  each push is applied when it arrives; pulls are answered at once
    ssp    as async, but a pull of a worker at clock c waits while the slowest live
           worker's clock is below c - s (s = staleness; s = 0 is lock-step)

A server needs no user code: worker 0's first message carries the initial shard and the
job's Settings (optimizer, consistency, copies). The server keeps a clock per worker
(the steps it has pushed), logs every answered pull with the clocks then (`answered`, to
check the staleness bound afterwards), and refuses, logs and survives any malformed,
forged or out-of-place message; frames larger than a shard's are refused before they are
read (wire.cap_frames). A worker silent for `worker_timeout` while the others wait on it
(or, one that has pushed no step yet, for `start_timeout`: its start-up and first step,
counted from the server's start or its first message) is dropped from
the clocks (or, with on_worker_loss="fail", stops the job). With a snapshot folder each
shard copy's values, optimizer state and clocks are saved atomically every K updates, and
a server started on that folder resumes from the newest snapshots.

With `copies` R > 1 a server holds its own shard and backup copies of the R-1 shards
before it (dtrain.ps.chain). As the head of a shard it applies each init, push and stop
(dtrain.ps.shard), relays it to the next live copy, and acknowledges the worker once that
copy acknowledged (chain replication; a middle copy relays on the same way). A server that
a worker addresses about a shard it is a backup of takes that shard over: the workers do
so when they see its head's connection drop (dtrain.ps.link). From then on it refuses the
old head's relays, so a head taken for dead by mistake cannot acknowledge anything more.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import zmq

from dtrain import faults
from dtrain.checkpoint import atomic
from dtrain.comm.ops import shard_sizes
from dtrain.errors import ConfigError, DtrainError
from dtrain.ps import chain, link
from dtrain.ps.shard import Clocks, ShardCopy
from dtrain.ps.wire import BadMessage, Message, cap_frames, pack, unpack

log = logging.getLogger("dtrain.ps")
LOG_RECORDS = 100_000


@dataclass
class Answered:
    """One answered pull: who, at which clock, and the slowest live clock then."""

    worker: int
    clock: int
    slowest: int


@dataclass
class Relay:
    """An event passed down a shard's chain, and the acknowledgement that waits on it."""

    upstream: bytes | None  # whom to acknowledge once `dest` did (None: a drop, nobody)
    reply: Message
    event: Message
    shard: int
    dest: int


class Server:
    """Serve one shard (and, with copies, backup copies of others) until every worker
    has stopped or been dropped.

    Args:
        workers: number of workers in the job.
        secret: the job's shared key; messages not signed with it are refused.
        numel: the model's parameter count (the flat vector all servers split); frames
            larger than a shard's bytes are refused unread.
        index: this server's place among the servers (its shard, and its snapshots' name).
        servers: how many servers the job has.
        bind: ZeroMQ address; loopback by default (port 0: the OS picks, see `address`).
        snapshot_dir: folder for snapshots; if it holds this server's, the server resumes
            from the newest ones.
        snapshot_every: snapshot after every this many applied updates (0: never).

    Raises:
        ConfigError: fewer than one worker, an index out of range, or snapshots asked for
            without a folder.
    """

    def __init__(self, workers: int, secret: bytes, numel: int, index: int = 0,
                 servers: int = 1, bind: str = "tcp://127.0.0.1:0",
                 snapshot_dir: str | Path | None = None, snapshot_every: int = 0) -> None:
        if workers < 1:
            raise ConfigError(f"a parameter server needs at least one worker, not {workers}")
        if not 0 <= index < servers:
            raise ConfigError(f"server index {index} with {servers} server(s)")
        if snapshot_every and snapshot_dir is None:
            raise ConfigError("snapshot_every needs a snapshot folder")
        self.workers, self.secret, self.index, self.servers = workers, secret, index, servers
        self.lengths = shard_sizes(numel, servers)
        self.snapshot_dir = None if snapshot_dir is None else Path(snapshot_dir)
        self.snapshot_every = snapshot_every
        self.copies: dict[int, ShardCopy] = {}
        """The shard copies this server holds, by shard."""
        self.heads = {index}
        """The shards whose head this server is (its own, and those it took over)."""
        self.peers: list[str] = []
        self.dead: set[int] = set()
        """Servers seen gone (a relay's connection dropped)."""
        # The newest records only: a long run answers millions of pulls.
        self.answered: deque[Answered] = deque(maxlen=LOG_RECORDS)
        self.rejected: deque[str] = deque(maxlen=LOG_RECORDS)
        self.failure = ""
        self._waiting: list[tuple[bytes, Message, int]] = []
        self._heard: dict[int, float] = {}
        """When each worker's last message came; absent until its first."""
        self._started = time.monotonic()
        self._relays: dict[int, Relay] = {}
        self._relay_ids = itertools.count()
        self._links: dict[int, tuple[zmq.Socket, zmq.Socket | None]] = {}
        for k in range(servers):
            if self.snapshot_dir is not None and atomic.read_index(self._snapshots(k)):
                self._copy(k)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        cap_frames(self._socket, max(self.lengths))  # before bind: connections copy it
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        host, _, port = bind.rpartition(":")
        if port == "0":
            self.address = f"{host}:{self._socket.bind_to_random_port(host)}"
        else:
            self._socket.bind(bind)
            self.address = bind

    def set_peers(self, addresses: list[str]) -> None:
        """The addresses of every server of the job, in index order: where this one relays
        its shards' events when `copies` > 1."""
        self.peers = list(addresses)

    @property
    def own(self) -> ShardCopy:
        """The copy of this server's own shard."""
        return self._copy(self.index)

    @property
    def initialized(self) -> bool:
        return self.own.initialized

    @property
    def clocks(self) -> Clocks:
        return self.own.clocks

    def _snapshots(self, k: int) -> Path:
        name = f"server-{self.index}" if k == self.index else f"server-{self.index}-shard-{k}"
        return self.snapshot_dir / name

    def _copy(self, k: int) -> ShardCopy:
        if k not in self.copies:
            snapshots = None if self.snapshot_dir is None else self._snapshots(k)
            self.copies[k] = ShardCopy(k, self.lengths[k], self.workers, snapshots,
                                       self.snapshot_every)
        return self.copies[k]

    # ------------------------------------------------------------------ loop
    def _finished(self) -> bool:
        return (bool(self.copies) and not self._relays
                and not any(c.clocks.live() for c in self.copies.values()))

    def serve(self, idle_timeout: float = 600.0) -> None:
        """Answer messages until every worker has stopped or been dropped.

        Raises:
            DtrainError: with on_worker_loss="fail", a worker went silent; or no message
                came for `idle_timeout` seconds.
        """
        last = time.monotonic()
        try:
            while not self._finished() and not self.failure:
                ready = dict(self._poller.poll(200))
                if ready:
                    last = time.monotonic()
                elif time.monotonic() - last > idle_timeout:
                    raise DtrainError(f"parameter server {self.index}: no message for "
                                      f"{idle_timeout:.0f}s; are the workers alive?")
                if self._socket in ready:
                    identity, *frames = self._socket.recv_multipart(copy=False)
                    try:
                        self._handle(identity.bytes, unpack(self.secret, frames))
                    except BadMessage as exc:
                        self._reject(identity.bytes, str(exc))
                for peer, (socket, monitor) in list(self._links.items()):
                    if socket in ready:
                        self._acknowledged(socket)
                    if monitor in ready and link.gone(monitor):
                        self._lost(peer)
                self._check_silent()
                self._answer_ready()
            if self.failure:
                raise DtrainError(self.failure)
            for k, copy in sorted(self.copies.items()):
                log.info("parameter server %d, shard %d: pushes applied per worker %s, "
                         "resends dropped as already applied %d", self.index, k,
                         copy.applied, copy.duplicates)
        finally:
            for socket, monitor in self._links.values():
                link.close(socket, monitor)
            self._socket.close()
            self._context.term()

    def _reply(self, identity: bytes, reply: Message) -> None:
        self._socket.send_multipart([identity, *pack(self.secret, reply)], copy=False)

    def _reject(self, identity: bytes, reason: str, m: Message | None = None) -> None:
        log.warning("parameter server %d rejected a message: %s", self.index, reason)
        self.rejected.append(reason)
        shard, relay = (None, None) if m is None else (m.shard, m.relay)
        self._reply(identity, Message("reply", -1, -1, error=reason, shard=shard, relay=relay))

    def _handle(self, identity: bytes, m: Message) -> None:
        if m.worker not in range(self.workers):
            raise BadMessage(f"unknown worker {m.worker}")
        if m.op == "stats":
            stats = {str(k): c.stats() for k, c in self.copies.items()}
            self._reply(identity, Message("reply", -1, m.clock, meta={
                "shards": stats, "heads": sorted(self.heads), "dead": sorted(self.dead)}))
            return
        k = self.index if m.shard is None else m.shard
        if m.relay is not None:
            try:
                self._relayed(identity, m, k)
            except BadMessage as exc:
                self._reject(identity, str(exc), m)
            return
        if k != self.index and k not in self.copies:
            raise BadMessage(f"parameter server {self.index} holds no copy of shard {k}")
        copy = self._copy(k)
        if m.worker in copy.clocks.dropped:
            raise BadMessage(f"worker {m.worker} was dropped after "
                             f"{copy.settings.worker_timeout:.0f}s of silence; it is no longer "
                             "part of this job")
        if k not in self.heads:
            self._take_over(k)
        try:
            self._dispatch(identity, m, copy)
        finally:
            # Stamped when handled, not when received: a worker cannot speak while the
            # server works on its message (worker 0's init builds the optimizer, which
            # can take a second), and that time is not its silence.
            self._heard[m.worker] = time.monotonic()

    def _dispatch(self, identity: bytes, m: Message, copy: ShardCopy) -> None:
        if m.op == "pull":
            self._waiting.append((identity, m, copy.shard))
            return
        if m.op not in ("init", "push", "stop"):
            raise BadMessage(f"a worker may not send {m.op!r}")
        if m.op == "push":
            faults.at("push", m.clock, server=self.index)
        self._apply(m, copy)
        clock = copy.clocks.of[m.worker] if m.op == "init" else m.clock
        self._replicate(identity, Message("reply", -1, clock, shard=copy.shard), m, copy)

    @staticmethod
    def _apply(m: Message, copy: ShardCopy) -> None:
        """Apply one event of a shard's sequence (dtrain.ps.shard) to `copy`."""
        if m.op == "init":
            copy.seed(m)
        elif m.op == "push":
            copy.push(m)
        elif m.op == "stop":
            copy.stop(m.worker)
        elif m.op == "drop":
            copy.drop(m.worker)
        else:
            raise BadMessage(f"{m.op!r} is not an event of a shard")

    # ------------------------------------------------------------------ replication
    def _next(self, copy: ShardCopy) -> int | None:
        copies = copy.settings.copies if copy.initialized else 1
        return chain.after(copy.shard, self.index, self.servers, copies, self.dead)

    def _replicate(self, upstream: bytes | None, reply: Message, event: Message,
                   copy: ShardCopy) -> None:
        """Pass `event` to the next live copy of its shard, and send `reply` upstream once
        that copy acknowledged it (at once when this copy is the last)."""
        dest = self._next(copy)
        if dest is None:
            if upstream is not None:
                self._reply(upstream, reply)
            return
        relay = next(self._relay_ids)
        self._relays[relay] = Relay(upstream, reply, event, copy.shard, dest)
        self._send_relay(relay)

    def _send_relay(self, relay: int) -> None:
        r = self._relays[relay]
        if r.dest not in self._links:
            self._links[r.dest] = link.connect(self._context, self.peers[r.dest],
                                               max(self.lengths), watch=True)
            for socket in self._links[r.dest]:
                self._poller.register(socket, zmq.POLLIN)
        e = r.event
        frames = pack(self.secret, Message(e.op, e.worker, e.clock, e.tensor, meta=e.meta,
                                           shard=r.shard, relay=relay))
        self._links[r.dest][0].send_multipart(frames, copy=False)

    def _relayed(self, identity: bytes, m: Message, k: int) -> None:
        """An event relayed by the copy before this one in shard k's chain."""
        if k in self.heads:
            raise BadMessage(f"parameter server {self.index} has taken over shard {k}; its "
                             "former head is out of the chain")
        copy = self._copy(k)
        self._apply(m, copy)
        self._replicate(identity, Message("reply", -1, m.clock, shard=k, relay=m.relay), m,
                        copy)

    def _acknowledged(self, socket: zmq.Socket) -> None:
        try:
            answer = unpack(self.secret, socket.recv_multipart(copy=False))
        except BadMessage as exc:
            log.warning("parameter server %d: unreadable answer to a relay: %s", self.index, exc)
            return
        r = self._relays.pop(answer.relay, None) if answer.relay is not None else None
        if r is None or r.upstream is None:
            return
        if r.event.op == "push" and r.shard in self.heads and not answer.error:
            faults.at("relayed", r.event.clock, server=self.index)
        if answer.error:
            r.reply = Message("reply", -1, -1, error=answer.error, shard=r.shard,
                              relay=r.reply.relay)
        self._reply(r.upstream, r.reply)

    def _lost(self, peer: int) -> None:
        """Server `peer`'s connection dropped: relay what it did not acknowledge to the
        next live copy instead (events are idempotent, so one it did apply is not applied
        twice), or acknowledge it here when no copy is left after this one."""
        log.warning("parameter server %d: server %d is gone; its shards' chains go on "
                    "without it", self.index, peer)
        self.dead.add(peer)
        socket, monitor = self._links.pop(peer)
        for s in (socket, monitor):
            self._poller.unregister(s)
        link.close(socket, monitor)
        for relay, r in list(self._relays.items()):
            if r.dest != peer:
                continue
            r.dest = self._next(self.copies[r.shard])
            if r.dest is None:
                del self._relays[relay]
                if r.upstream is not None:
                    self._reply(r.upstream, r.reply)
            else:
                self._send_relay(relay)

    def _take_over(self, k: int) -> None:
        log.warning("parameter server %d takes over shard %d: a worker found its earlier "
                    "copies gone", self.index, k)
        self.heads.add(k)
        now = time.monotonic()  # silences are counted from here for this shard's workers
        for w in self.copies[k].clocks.live():
            self._heard[w] = now

    # ------------------------------------------------------------------ pulls
    def _answer_ready(self) -> None:
        still = []
        for identity, m, k in self._waiting:
            copy = self.copies[k]
            if copy.ready(m.clock):
                self.answered.append(Answered(m.worker, m.clock, copy.clocks.slowest()))
                # a copy: ZeroMQ sends later from this memory, and updates change the shard
                self._reply(identity, Message("reply", -1, copy.clocks.of[m.worker],
                                              copy.param.detach().clone(), shard=k))
            else:
                still.append((identity, m, k))
        self._waiting = still

    # ------------------------------------------------------------------ faults
    def _check_silent(self) -> None:
        """Drop (or fail on) a live worker that others wait on and that went silent."""
        for k in sorted(self.heads & set(self.copies)):
            copy = self.copies[k]
            waiting = [m.worker for _, m, shard in self._waiting if shard == k]
            live = copy.clocks.live()
            waited_on = bool(waiting) or (len(live) == 1 and bool(copy.clocks.done))
            if not waited_on or not copy.initialized:  # start-up may be slow; the workers'
                continue  # own timeout covers a worker 0 that never seeds the servers
            now, timeout = time.monotonic(), copy.settings.worker_timeout
            for w in sorted(live):
                silent = now - self._heard.get(w, self._started)
                started = w in self._heard and copy.clocks.of[w] > 0  # a step pushed
                allowed = timeout if started else max(timeout, copy.settings.start_timeout)
                if silent <= allowed or w in waiting:
                    continue
                if copy.settings.on_worker_loss == "fail":
                    self._fail(f"worker {w} sent nothing for {allowed:.0f}s; the job stops "
                               "(on_worker_loss='fail')")
                    return
                drop = Message("drop", w, copy.clocks.of[w], shard=k)
                copy.drop(w)
                self._replicate(None, Message("reply", -1, 0, shard=k), drop, copy)
                log.warning("parameter server %d: worker %d sent nothing for %.0fs and is "
                            "dropped from the clocks; %d live worker(s) go on", self.index,
                            w, allowed, len(copy.clocks.live()))

    def _fail(self, reason: str) -> None:
        self.failure = reason
        for identity, _, k in self._waiting:
            self._reply(identity, Message("reply", -1, -1, error=reason, shard=k))
        self._waiting = []
