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
(or, one that has pushed no step yet, for `start_timeout`: its start-up and first step)
is dropped from the clocks (or, with on_worker_loss="fail", stops the job). A worker's
silence is counted from its first message to this server: one that starts late on a
loaded machine is not dropped before it has said anything. With a snapshot folder each
shard copy's values, optimizer state and clocks are saved atomically every K updates, and
a server started on that folder resumes from the newest snapshots.

With `copies` R > 1 a server holds its own shard and backup copies of the R-1 shards
before it (dtrain.ps.chain). As the head of a shard it applies each init, push and stop
(dtrain.ps.shard), relays it to the next live copy, and acknowledges the worker once that
copy acknowledged (chain replication; a middle copy relays on the same way). A server that
a worker addresses about a shard it is a backup of takes that shard over: the workers do
so when they see its head's connection drop (dtrain.ps.link). From then on it refuses the
old head's relays, so a head taken for dead by mistake cannot acknowledge anything more.

A dead server is replaced: a new process started with `join=True` in its slot asks to
join each of the slot's chains (dtrain.ps.joining). The head admits it as an event of the
shard's sequence, which travels down the chain like a push; the copy whose next it then
is (the tail) sends it its state first (dtrain.ps.handoff), then relays it that event and
every later one, each acknowledged only once the new copy has it. So the pushes that
arrive during the copy are neither lost (they follow the cut) nor applied twice (the state
holds those before it, and a resend is known by its id), and the chain has its R copies
again: the next death is survived the same way. Every answer to a worker carries the
chain as its head knows it (without a member whose join is not acknowledged yet), so the
workers know the new copy before they need it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq

from dtrain import faults
from dtrain.checkpoint import atomic
from dtrain.comm.ops import shard_sizes
from dtrain.errors import ConfigError, DtrainError
from dtrain.ps import chain as chains
from dtrain.ps import handoff, link
from dtrain.ps.chain import Chain
from dtrain.ps.joining import Joining, Request
from dtrain.ps.shard import Clocks, ShardCopy
from dtrain.ps.wire import SERVER_OPS, BadMessage, Message, cap_frames, pack, unpack

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
    dest: str  # the next copy's address


class Server:
    """Serve one shard (and, with copies, backup copies of others) until every worker
    has stopped or been dropped.

    Args:
        workers: number of workers in the job.
        secret: the job's shared key; messages not signed with it are refused.
        numel: the model's parameter count (the flat vector all servers split); frames
            larger than a shard's bytes are refused unread.
        index: this server's slot among the servers (its shard, and its snapshots' name).
        servers: how many servers the job has.
        bind: ZeroMQ address; loopback by default (port 0: the OS picks, see `address`).
        snapshot_dir: folder for snapshots; if it holds this server's, the server resumes
            from the newest ones.
        snapshot_every: snapshot after every this many applied updates (0: never).
        join: this process takes the slot of a dead server (whose address `set_peers`
            gives at `index`): it resumes nothing from snapshots and copies each shard of
            the slot from a live copy as `serve` starts (dtrain.ps.joining).

    Raises:
        ConfigError: fewer than one worker, an index out of range, or snapshots asked for
            without a folder.
    """

    def __init__(self, workers: int, secret: bytes, numel: int, index: int = 0,
                 servers: int = 1, bind: str = "tcp://127.0.0.1:0",
                 snapshot_dir: str | Path | None = None, snapshot_every: int = 0,
                 join: bool = False) -> None:
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
        self.chains: dict[int, Chain] = {}
        """Each held shard's live copies in order, as this server knows them."""
        self.heads = set() if join else {index}
        """The shards whose head this server is (its own, and those it took over)."""
        self.peers: list[str] = []
        self.dead: set[str] = set()
        """Addresses of servers seen gone (a connection dropped, or a new one took the
        slot)."""
        # The newest records only: a long run answers millions of pulls.
        self.answered: deque[Answered] = deque(maxlen=LOG_RECORDS)
        self.rejected: deque[str] = deque(maxlen=LOG_RECORDS)
        self.failure = ""
        self.joining: Joining | None = None
        self._join = join
        self._waiting: list[tuple[bytes, Message, int]] = []
        self._heard: dict[int, float] = {}
        """When each worker's last message came; absent until its first."""
        self._workers: dict[int, bytes] = {}
        """Each worker's connection, as its last message came (where news of a chain goes)."""
        self._relays: dict[int, Relay] = {}
        self._relay_ids = itertools.count()
        self._synced: dict[int, set[str]] = {}
        """Per shard, the next copies known to hold its state (the first chain's, and
        those this server sent its state to)."""
        self._incoming = handoff.Incoming()
        self._links: dict[str, tuple[zmq.Socket, zmq.Socket | None]] = {}
        for k in range(servers):
            if not join and self.snapshot_dir is not None \
                    and atomic.read_index(self._snapshots(k)):
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
        """The addresses of every server of the job, by slot: where this one relays its
        shards' events when `copies` > 1 (with `join`, the dead one's at this slot).

        Raises:
            ConfigError: with `join`, the dead server's address is this one's.
        """
        self.peers = list(addresses)
        if self._join:
            try:
                self.joining = Joining(self.index, self.address, self.peers)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None

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

    def _chain(self, k: int) -> Chain:
        """Shard k's chain as this server knows it: at first the slots' order (kept once
        the copy knows its settings' copies)."""
        if k in self.chains:
            return self.chains[k]
        copy = self.copies.get(k)
        copies = copy.settings.copies if copy is not None and copy.initialized else 1
        addresses = self.peers or [self.address if s == self.index else ""
                                   for s in range(self.servers)]
        first = Chain.first(k, addresses, copies)
        if copy is not None and copy.initialized:
            self.chains[k], self._synced[k] = first, set(first.addresses)
        return first

    # ------------------------------------------------------------------ loop
    def _finished(self) -> bool:
        return (bool(self.copies) and not self._relays
                and (self.joining is None or self.joining.done)
                and not any(c.clocks.live() for c in self.copies.values()))

    def serve(self, idle_timeout: float = 600.0,
              job_over: Callable[[], bool] | None = None) -> None:
        """Answer messages until every worker has stopped or been dropped.

        Args:
            idle_timeout: seconds without a message after which the server gives up.
            job_over: with `join`, asked every second until every shard is joined: True
                once the job's workers are done (a server finished), so that a server
                started too late to join has nothing left to do and returns.

        Raises:
            DtrainError: with on_worker_loss="fail", a worker went silent; or no message
                came for `idle_timeout` seconds.
        """
        last = asked_over = time.monotonic()
        if self._join and self.joining is None:
            raise ConfigError(f"parameter server {self.index} joins in a dead one's place: "
                              "give it the servers' addresses first (set_peers)")
        if self.joining is not None:
            log.warning("parameter server %d at %s takes the place of %s: it joins the chains "
                        "of its shards", self.index, self.address, self.joining.request.replaces)
            for k, address in self.joining.first(self.dead):
                self._ask_to_join(k, address)
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
                        self._answer_from(socket)
                    if monitor in ready and link.gone(monitor):
                        self._lost(peer)
                self._check_silent()
                self._answer_ready()
                if self.joining is not None and not self.joining.done:
                    for k, address in self.joining.due(time.monotonic(), self.dead):
                        self._ask_to_join(k, address)
                    if job_over is not None and time.monotonic() - asked_over > 1:
                        asked_over = time.monotonic()
                        if job_over():
                            log.warning("parameter server %d: the job's workers are done "
                                        "before it joined every chain", self.index)
                            return
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

    def _reject(self, identity: bytes, reason: str, m: Message | None = None,
                meta: dict[str, object] | None = None) -> None:
        log.warning("parameter server %d rejected a message: %s", self.index, reason)
        self.rejected.append(reason)
        shard, relay = (None, None) if m is None else (m.shard, m.relay)
        self._reply(identity, Message("reply", -1, -1, error=reason, meta=meta, shard=shard,
                                      relay=relay))

    def _handle(self, identity: bytes, m: Message) -> None:
        k = self.index if m.shard is None else m.shard
        if not 0 <= k < self.servers:
            raise BadMessage(f"shard {k} of a job of {self.servers} server(s)")
        if m.op in SERVER_OPS and m.relay is None:
            self._from_server(identity, m, k)
            return
        if m.relay is not None:
            try:
                self._relayed(identity, m, k)
            except BadMessage as exc:
                self._reject(identity, str(exc), m)
            return
        if m.worker not in range(self.workers):
            raise BadMessage(f"unknown worker {m.worker}")
        if m.op == "stats":
            self._reply(identity, Message("reply", -1, m.clock, meta=self.stats()))
            return
        if k != self.index and k not in self.copies:
            raise BadMessage(f"parameter server {self.index} holds no copy of shard {k}")
        copy = self._copy(k)
        if m.worker in copy.clocks.dropped:
            raise BadMessage(f"worker {m.worker} was dropped after "
                             f"{copy.settings.worker_timeout:.0f}s of silence; it is no longer "
                             "part of this job")
        if k not in self.heads:
            self._take_over(k, "a worker found its earlier copies gone")
        try:
            self._dispatch(identity, m, copy)
        finally:
            # Stamped when handled, not when received: a worker cannot speak while the
            # server works on its message (worker 0's init builds the optimizer, which
            # can take a second), and that time is not its silence.
            self._heard[m.worker] = time.monotonic()
            self._workers[m.worker] = identity

    def stats(self) -> dict[str, object]:
        """This server's counters: per shard copy what it applied (dtrain.ps.shard), the
        shards it heads, the chains as it knows them, the servers it saw gone, the shards
        it joined (None: it took no dead server's place), and what it waits on (relays
        not yet acknowledged, pulls not yet answerable)."""
        return {"slot": self.index, "address": self.address,
                "shards": {str(k): c.stats() for k, c in self.copies.items()},
                "heads": sorted(self.heads),
                "chains": {str(k): c.to_json() for k, c in self.chains.items()},
                "dead": sorted(self.dead),
                "relays": [[r.event.op, r.event.worker, r.event.clock, r.shard, r.dest]
                           for r in self._relays.values()],
                "waiting": [[m.worker, m.clock, k] for _, m, k in self._waiting],
                "joined": None if self.joining is None else sorted(self.joining.joined)}

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
        self._replicate(identity, Message("reply", -1, clock, meta=self._chain_meta(copy.shard),
                                          shard=copy.shard), m, copy)

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

    def _chain_meta(self, k: int) -> dict[str, object] | None:
        """What an answer to a worker about shard k carries: its chain, without a new copy
        whose join is not acknowledged yet (its state may not have reached it)."""
        copy = self.copies.get(k)
        if copy is None or not copy.initialized:
            return None
        return {"chain": self._chain(k).to_json(leaving_out=self._joining(k))}

    def _join_meta(self, k: int) -> dict[str, object]:
        """What the answer to a join of shard k that is done carries: the chain, and the
        job's copies of each shard (so the new server knows which shards are its)."""
        return {**(self._chain_meta(k) or {}), "copies": self.copies[k].settings.copies}

    def _joining(self, k: int) -> set[str]:
        """The new copies of shard k whose join this server relayed and is not yet
        acknowledged."""
        return {str(r.event.meta["address"]) for r in self._relays.values()
                if r.shard == k and r.event.op == "join" and r.event.meta}

    # ------------------------------------------------------------------ replication
    def _next(self, k: int) -> str | None:
        """The address of the copy after this one in shard k's chain (None: none)."""
        chain = self._chain(k)
        member = chain.after(self.address) if self.address in chain.addresses else None
        return None if member is None else member.address

    def _replicate(self, upstream: bytes | None, reply: Message, event: Message,
                   copy: ShardCopy) -> None:
        """Pass `event` to the next live copy of its shard, and send `reply` upstream once
        that copy acknowledged it (at once when this copy is the last)."""
        dest = self._next(copy.shard)
        if dest is None:
            if upstream is not None:
                self._reply(upstream, reply)
            return
        relay = next(self._relay_ids)
        self._relays[relay] = Relay(upstream, reply, event, copy.shard, dest)
        self._send_relay(relay)

    def _link(self, address: str) -> zmq.Socket:
        """The connection to the server at `address` (made, and watched, at first use)."""
        if address not in self._links:
            self._links[address] = link.connect(self._context, address, max(self.lengths),
                                                watch=True)
            for socket in self._links[address]:
                self._poller.register(socket, zmq.POLLIN)
        return self._links[address][0]

    def _send_relay(self, relay: int) -> None:
        r = self._relays[relay]
        if r.dest not in self._synced.setdefault(r.shard, set()):
            self._send_state(r.shard, r.dest)
        e = r.event
        frames = pack(self.secret, Message(e.op, e.worker, e.clock, e.tensor, meta=e.meta,
                                           shard=r.shard, relay=relay))
        self._link(r.dest).send_multipart(frames, copy=False)

    def _send_state(self, k: int, dest: str) -> None:
        """Give the new copy at `dest` this copy's state of shard k, before anything else
        about shard k goes to it (dtrain.ps.handoff)."""
        copy = self.copies[k]
        log.warning("parameter server %d sends its copy of shard %d (update %d) to %s, the "
                    "chain's new tail", self.index, k, copy.updates, dest)
        socket = self._link(dest)
        for m in handoff.messages(k, copy, self._chain(k)):
            socket.send_multipart(pack(self.secret, m), copy=False)
        self._synced[k].add(dest)

    def _relayed(self, identity: bytes, m: Message, k: int) -> None:
        """An event relayed by the copy before this one in shard k's chain."""
        if k in self.heads:
            raise BadMessage(f"parameter server {self.index} has taken over shard {k}; its "
                             "former head is out of the chain")
        if k not in self.copies and (self._join or m.op == "join"):
            raise BadMessage(f"parameter server {self.index} has no copy of shard {k} yet")
        if m.op == "join":
            self._admit(k, Request.of(m, self.servers))
        else:
            self._apply(m, self._copy(k))
        self._replicate(identity, Message("reply", -1, m.clock, shard=k, relay=m.relay), m,
                        self.copies[k])

    def _answer_from(self, socket: zmq.Socket) -> None:
        """An answer from another server: to a relay, or to this one's join request."""
        try:
            answer = unpack(self.secret, socket.recv_multipart(copy=False))
        except BadMessage as exc:
            log.warning("parameter server %d: unreadable answer from a server: %s", self.index,
                        exc)
            return
        if answer.relay is None:
            if self.joining is not None and not self.joining.done:
                again = self.joining.answered(answer, self.dead)
                if again is not None and answer.shard is not None:
                    self._ask_to_join(answer.shard, again)
                elif self.joining.done:
                    log.warning("parameter server %d joined the chains of shards %s: each has "
                                "its copies again", self.index, sorted(self.joining.joined))
            return
        r = self._relays.pop(answer.relay, None)
        if r is None or r.upstream is None:
            return
        if r.event.op == "push" and r.shard in self.heads and not answer.error:
            faults.at("relayed", r.event.clock, server=self.index)
        if answer.error:
            r.reply = Message("reply", -1, -1, error=answer.error, shard=r.shard,
                              relay=r.reply.relay)
        elif r.event.op == "join" and r.shard in self.heads:  # now a worker may use it
            r.reply = Message("reply", -1, 0, meta=self._join_meta(r.shard), shard=r.shard)
            self._tell_workers(r.shard)
        self._reply(r.upstream, r.reply)

    def _tell_workers(self, k: int) -> None:
        """Send every live worker shard k's chain unasked (a new copy joined it), so that
        one whose next request comes only after another death still knows the new copy:
        the news waits in its connection, read before that death is."""
        news = Message("chain", -1, -1, meta=self._chain_meta(k), shard=k)
        for w in sorted(self.copies[k].clocks.live() & set(self._workers)):
            self._reply(self._workers[w], news)

    def _lost(self, peer: str) -> None:
        """The server at `peer` is gone (its connection dropped, or a new process took its
        slot): relay what it did not acknowledge to the next live copy instead (events are
        idempotent, so one it did apply is not applied twice), or acknowledge it here when
        no copy is left after this one."""
        if peer in self.dead:
            return
        log.warning("parameter server %d: server %s is gone; its shards' chains go on "
                    "without it", self.index, peer)
        self.dead.add(peer)
        if peer in self._links:
            socket, monitor = self._links.pop(peer)
            for s in (socket, monitor):
                if s is not None:
                    self._poller.unregister(s)
            link.close(socket, monitor)
        for chain in self.chains.values():
            chain.remove({peer})
        for relay, r in list(self._relays.items()):
            if r.dest != peer:
                continue
            dest = self._next(r.shard)
            if dest is None:
                del self._relays[relay]
                if r.upstream is not None:
                    self._reply(r.upstream, r.reply)
            else:
                r.dest = dest
                self._send_relay(relay)
        if self.joining is not None:
            for k, (asked, _) in list(self.joining.asked.items()):
                holders = self.joining.holders(k, self.dead)
                if asked == peer and holders:
                    self._ask_to_join(k, holders[0])

    def _take_over(self, k: int, why: str) -> None:
        log.warning("parameter server %d takes over shard %d: %s", self.index, k, why)
        self.heads.add(k)
        chain = self._chain(k)
        if self.address in chain.addresses:
            chain.start_at(self.address)
        now = time.monotonic()  # silences are counted from here for this shard's workers
        for w in self.copies[k].clocks.live():
            self._heard[w] = now

    # ------------------------------------------------------------------ replacement
    def _from_server(self, identity: bytes, m: Message, k: int) -> None:
        """A message of another server that is not a relay: a part or the whole of a
        shard's state (a join's), or a new server's request to join shard k."""
        if m.op == "part":
            self._incoming.part(identity, m)
        elif m.op == "state":
            self._received_state(identity, m, k)
        else:
            self._join_request(identity, m, k)

    def _received_state(self, identity: bytes, m: Message, k: int) -> None:
        state, chain = self._incoming.state(identity, m)
        copy = ShardCopy(k, self.lengths[k], self.workers,
                         None if self.snapshot_dir is None else self._snapshots(k),
                         self.snapshot_every, resume=False)
        try:
            copy.load_state(state)
        except (ConfigError, KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise BadMessage(f"malformed state of shard {k}: {exc}") from None
        if self.address not in chain.addresses:
            raise BadMessage(f"a state of shard {k} whose chain {chain.addresses} does not "
                             f"list this server ({self.address})")
        copy.copied_from = {"updates": copy.updates,
                            "applied": {str(w): n for w, n in copy.applied.items()}}
        self.copies[k], self.chains[k] = copy, chain
        self._synced[k] = set(chain.addresses[:chain.addresses.index(self.address) + 1])
        log.warning("parameter server %d holds a copy of shard %d from update %d on (pushes "
                    "applied per worker so far %s)", self.index, k, copy.updates, copy.applied)

    def _join_request(self, identity: bytes, m: Message, k: int) -> None:
        """A new server asks to join shard k's chain in a dead one's slot: admitted here
        if this server is the shard's head (once the dead one is left out), else told
        where the head is."""
        request = Request.of(m, self.servers)
        if self.address in (request.replaces, request.joiner.address):
            raise BadMessage(f"parameter server {self.index} at {self.address} is alive: a new "
                             "server cannot take its place")
        copy = self.copies.get(k)
        if copy is None or not copy.initialized:
            self._reject(identity, f"parameter server {self.index} holds no seeded copy of "
                         f"shard {k} yet", m)
            return
        copies = copy.settings.copies
        slots = chains.holders(k, self.servers, copies)
        if request.joiner.slot not in slots:
            self._reject(identity, f"slot {request.joiner.slot} holds no copy of shard {k} "
                         f"(slots {slots})", m, {"held": False, "copies": copies})
            return
        self._lost(request.replaces)
        chain = self._chain(k)
        filled = chain.of_slot(request.joiner.slot)
        if filled is not None and filled != request.joiner:
            self._reject(identity, f"slot {request.joiner.slot} of shard {k} is taken by "
                         f"{filled.address}", m, {"held": False, "copies": copies})
            return
        head = chain.head
        if head is None or head.address != self.address:
            self._reject(identity, f"parameter server {self.index} is not the head of shard {k}",
                         m, {"chain": chain.to_json(), "copies": copies})
            return
        if k not in self.heads:
            self._take_over(k, f"server {request.replaces}, the head before it, is replaced")
        if filled is not None:  # asked again: joined already, or still joining
            if request.joiner.address in self._joining(k):
                self._reject(identity, f"the join of shard {k} is in progress", m,
                             {"copies": copies})
            else:
                self._reply(identity, Message("reply", -1, 0, meta=self._join_meta(k),
                                              shard=k))
            return
        event = Message("join", -1, 0, meta=request.meta(), shard=k)
        self._admit(k, request)
        self._replicate(identity, Message("reply", -1, 0, shard=k), event, copy)

    def _admit(self, k: int, request: Request) -> None:
        """The join event of shard k: the dead server is out of the chain, the new one
        is its tail.

        Raises:
            BadMessage: the join names this server as the dead one.
        """
        if request.replaces == self.address:
            raise BadMessage(f"a join of shard {k} in place of {request.replaces}: parameter "
                             f"server {self.index} at {self.address} is alive")
        self._lost(request.replaces)
        log.warning("parameter server %d: server %d at %s joins the chain of shard %d in "
                    "place of %s", self.index, request.joiner.slot, request.joiner.address, k,
                    request.replaces)
        self._chain(k).add(request.joiner)

    def _ask_to_join(self, k: int, address: str) -> None:
        assert self.joining is not None  # only a joining server asks
        self.joining.asked[k] = (address, time.monotonic())
        self._link(address).send_multipart(pack(self.secret, self.joining.message(k)),
                                           copy=False)

    # ------------------------------------------------------------------ pulls
    def _answer_ready(self) -> None:
        still = []
        for identity, m, k in self._waiting:
            copy = self.copies[k]
            if copy.ready(m.clock):
                self.answered.append(Answered(m.worker, m.clock, copy.clocks.slowest()))
                # a copy: ZeroMQ sends later from this memory, and updates change the shard
                self._reply(identity, Message("reply", -1, copy.clocks.of[m.worker],
                                              copy.param.detach().clone(),
                                              meta=self._chain_meta(k), shard=k))
            else:
                still.append((identity, m, k))
        self._waiting = still

    # ------------------------------------------------------------------ faults
    def _check_silent(self) -> None:
        """Drop (or fail on) a live worker that others wait on and that went silent since
        it first spoke (one never heard from has no silence counted yet)."""
        for k in sorted(self.heads & set(self.copies)):
            copy = self.copies[k]
            waiting = [m.worker for _, m, shard in self._waiting if shard == k]
            live = copy.clocks.live()
            waited_on = bool(waiting) or (len(live) == 1 and bool(copy.clocks.done))
            if not waited_on or not copy.initialized:  # start-up may be slow; the workers'
                continue  # own timeout covers a worker 0 that never seeds the servers
            now, timeout = time.monotonic(), copy.settings.worker_timeout
            for w in sorted(live):
                if w not in self._heard or w in waiting:
                    continue
                started = copy.clocks.of[w] > 0  # a step pushed
                allowed = timeout if started else max(timeout, copy.settings.start_timeout)
                if now - self._heard[w] <= allowed:
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
