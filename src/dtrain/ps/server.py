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
job's Settings (optimizer, consistency). The server keeps a clock per worker (the steps
it has pushed), logs every answered pull with the clocks then (`answered`, to check the
staleness bound afterwards), and refuses, logs and survives any malformed, forged or
out-of-place message. A worker silent for `worker_timeout` while the others wait on it (or,
one never heard from, for `start_timeout` since the server started) is dropped from the
clocks (or, with on_worker_loss="fail", stops the job). With a snapshot folder the shard,
optimizer state and clocks are saved atomically every K updates, and a
server started on that folder resumes from the newest snapshot.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
import zmq

from dtrain.checkpoint import atomic
from dtrain.errors import ConfigError, DtrainError
from dtrain.ps.settings import Settings
from dtrain.ps.wire import BadMessage, Message, pack, unpack

log = logging.getLogger("dtrain.ps")
LOG_RECORDS = 100_000


@dataclass
class Answered:
    """One answered pull: who, at which clock, and the slowest live clock then."""

    worker: int
    clock: int
    slowest: int


@dataclass
class Clocks:
    """Per-worker progress, and the synchronous round being gathered."""

    of: dict[int, int]
    done: set[int] = field(default_factory=set)  # said stop
    dropped: set[int] = field(default_factory=set)  # silent too long: counted as dead
    version: int = 0  # sync: pulls of clocks up to this are answerable
    round_sum: torch.Tensor | None = None
    round_from: set[int] = field(default_factory=set)
    round_lr: float | None = None

    def live(self) -> set[int]:
        return set(self.of) - self.done - self.dropped

    def slowest(self) -> int:
        return min((self.of[w] for w in self.live()), default=1 << 30)


class Server:
    """Serve one shard until every worker has stopped or been dropped.

    Args:
        workers: number of workers in the job.
        secret: the job's shared key; messages not signed with it are refused.
        index: this server's place among the servers (names its snapshots).
        bind: ZeroMQ address; loopback by default (port 0: the OS picks, see `address`).
        snapshot_dir: folder for snapshots; if it holds this server's, the server resumes
            from the newest one.
        snapshot_every: snapshot after every this many applied updates (0: never).

    Raises:
        ConfigError: fewer than one worker, or snapshots asked for without a folder.
    """

    def __init__(self, workers: int, secret: bytes, index: int = 0,
                 bind: str = "tcp://127.0.0.1:0", snapshot_dir: str | Path | None = None,
                 snapshot_every: int = 0) -> None:
        if workers < 1:
            raise ConfigError(f"a parameter server needs at least one worker, not {workers}")
        if snapshot_every and snapshot_dir is None:
            raise ConfigError("snapshot_every needs a snapshot folder")
        self.workers, self.secret, self.index = workers, secret, index
        self.settings: Settings | None = None
        self.param: torch.nn.Parameter | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.clocks = Clocks(of=dict.fromkeys(range(workers), 0))
        self.updates = 0
        self.snapshot_every = snapshot_every
        self.snapshots = None if snapshot_dir is None else Path(snapshot_dir) / f"server-{index}"
        # The newest records only: a long run answers millions of pulls.
        self.answered: deque[Answered] = deque(maxlen=LOG_RECORDS)
        self.rejected: deque[str] = deque(maxlen=LOG_RECORDS)
        self.failure = ""
        self._waiting: list[tuple[bytes, Message]] = []
        self._heard: dict[int, float] = {}
        """When each worker's last message came; absent until its first."""
        self._started = time.monotonic()
        if self.snapshots is not None and atomic.read_index(self.snapshots):
            self._restore()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        host, _, port = bind.rpartition(":")
        if port == "0":
            self.address = f"{host}:{self._socket.bind_to_random_port(host)}"
        else:
            self._socket.bind(bind)
            self.address = bind

    @property
    def initialized(self) -> bool:
        return self.param is not None

    # ------------------------------------------------------------------ loop
    def serve(self, idle_timeout: float = 600.0) -> None:
        """Answer messages until every worker has stopped or been dropped.

        Raises:
            DtrainError: with on_worker_loss="fail", a worker went silent; or no message
                came for `idle_timeout` seconds.
        """
        last = time.monotonic()
        try:
            while self.clocks.live() and not self.failure:
                if self._socket.poll(200):
                    last = time.monotonic()
                    identity, *frames = self._socket.recv_multipart(copy=False)
                    try:
                        self._handle(identity.bytes, unpack(self.secret, frames))
                    except BadMessage as exc:
                        self._reject(identity.bytes, str(exc))
                elif time.monotonic() - last > idle_timeout:
                    raise DtrainError(f"parameter server {self.index}: no message for "
                                      f"{idle_timeout:.0f}s; are the workers alive?")
                self._check_silent()
                self._answer_ready()
            if self.failure:
                raise DtrainError(self.failure)
        finally:
            self._socket.close()
            self._context.term()

    def _reply(self, identity: bytes, clock: int, tensor: torch.Tensor | None = None,
               error: str = "") -> None:
        frames = pack(self.secret, Message("reply", -1, clock, tensor, error))
        self._socket.send_multipart([identity, *frames], copy=False)

    def _reject(self, identity: bytes, reason: str) -> None:
        log.warning("parameter server %d rejected a message: %s", self.index, reason)
        self.rejected.append(reason)
        self._reply(identity, -1, error=reason)

    def _handle(self, identity: bytes, m: Message) -> None:
        if m.worker not in self.clocks.of:
            raise BadMessage(f"unknown worker {m.worker}")
        if m.worker in self.clocks.dropped:
            raise BadMessage(f"worker {m.worker} was dropped after "
                             f"{self.settings.worker_timeout:.0f}s of silence; it is no longer "
                             "part of this job")
        try:
            self._dispatch(identity, m)
        finally:
            # Stamped when handled, not when received: a worker cannot speak while the
            # server works on its message (worker 0's init builds the optimizer, which
            # can take a second), and that time is not its silence.
            self._heard[m.worker] = time.monotonic()

    def _dispatch(self, identity: bytes, m: Message) -> None:
        if m.op == "init":
            self._init(m)
            self._reply(identity, self.clocks.of[m.worker])
        elif m.op == "push":
            self._check_tensor(m, "push")
            self._push(m)
            self._reply(identity, m.clock)
        elif m.op == "pull":
            self._waiting.append((identity, m))
        elif m.op == "stop":
            self.clocks.done.add(m.worker)
            self._close_round()
            self._reply(identity, m.clock)
        else:
            raise BadMessage(f"a worker may not send {m.op!r}")

    def _init(self, m: Message) -> None:
        """Worker 0 seeds the shard and the settings; later inits (a restarted worker, or
        a server resumed from a snapshot) keep what the server has."""
        if m.worker != 0:
            raise BadMessage(f"worker {m.worker} sent init: only worker 0 seeds the servers")
        if self.initialized:
            log.info("parameter server %d: init again from worker 0; kept its shard", self.index)
            return
        if m.tensor is None or m.tensor.dtype != torch.float32:
            raise BadMessage("init needs a float32 tensor")
        try:
            settings = Settings.from_json(m.meta or {})
            param = torch.nn.Parameter(m.tensor.clone())
            optimizer = settings.build_optimizer([param])
        except (ConfigError, ValueError, TypeError) as exc:  # torch's checks of its options too
            raise BadMessage(str(exc)) from None
        self.settings, self.param, self.optimizer = settings, param, optimizer

    def _check_tensor(self, m: Message, what: str) -> None:
        if not self.initialized:
            raise BadMessage(f"{what} before worker 0 seeded the servers")
        if m.tensor is None or m.tensor.dtype != torch.float32:
            raise BadMessage(f"{what} needs a float32 tensor")
        if m.tensor.numel() != self.param.numel():
            raise BadMessage(f"{what} of {m.tensor.numel()} values, but this shard holds "
                             f"{self.param.numel()}")

    # ------------------------------------------------------------------ consistency
    def _apply(self, grad: torch.Tensor, lr: float | None) -> None:
        if lr is not None:  # the worker's scheduler decides the step size
            self.optimizer.param_groups[0]["lr"] = lr
        self.param.grad = grad
        self.optimizer.step()
        self.param.grad = None
        self.updates += 1
        if self.snapshot_every and self.updates % self.snapshot_every == 0:
            self._snapshot()

    def _push(self, m: Message) -> None:
        c, lr = self.clocks, self._lr(m)  # checked before anything changes
        expected = c.of[m.worker]
        if m.clock < expected:  # a resend of a push already counted
            log.info("worker %d resent push %d; already applied", m.worker, m.clock)
            return
        if m.clock > expected:  # only a server resumed from an older snapshot sees this
            log.warning("parameter server %d: worker %d pushed clock %d, expected %d (updates "
                        "after the last snapshot were lost)", self.index, m.worker, m.clock,
                        expected)
        c.of[m.worker] = m.clock + 1
        if self.settings.consistency != "sync":
            # 1/W of each push: a round of W pushes moves the parameters as far as one
            # sync step, so one lr means the same per sample in every mode.
            self._apply(m.tensor / self.workers, lr)
            return
        c.round_sum = m.tensor.clone() if c.round_sum is None else c.round_sum.add_(m.tensor)
        c.round_from.add(m.worker)
        c.round_lr = lr
        self._close_round()

    @staticmethod
    def _lr(m: Message) -> float | None:
        lr = (m.meta or {}).get("lr")
        if lr is None:
            return None
        if not isinstance(lr, int | float) or not 0 <= lr < float("inf"):
            raise BadMessage(f"lr {lr!r} is not a finite number >= 0")
        return float(lr)

    def _close_round(self) -> None:
        """sync: once every live worker's gradient is in, apply their mean."""
        c = self.clocks
        if c.round_sum is None or not c.live() <= c.round_from:
            return
        self._apply(c.round_sum / len(c.round_from), c.round_lr)
        c.version = max(c.of[w] for w in c.round_from)
        c.round_sum, c.round_from = None, set()

    def _ready(self, m: Message) -> bool:
        if not self.initialized:
            return False
        if self.settings.consistency == "sync":
            return self.clocks.version >= m.clock
        if self.settings.consistency == "ssp":
            return self.clocks.slowest() >= m.clock - self.settings.staleness
        return True

    def _answer_ready(self) -> None:
        still = []
        for identity, m in self._waiting:
            if self._ready(m):
                self.answered.append(Answered(m.worker, m.clock, self.clocks.slowest()))
                # a copy: ZeroMQ sends later from this memory, and updates change the shard
                self._reply(identity, self.clocks.of[m.worker], self.param.detach().clone())
            else:
                still.append((identity, m))
        self._waiting = still

    # ------------------------------------------------------------------ faults

    def _check_silent(self) -> None:
        """Drop (or fail on) a live worker that others wait on and that went silent."""
        live = self.clocks.live()
        waited_on = bool(self._waiting) or (len(live) == 1 and bool(self.clocks.done))
        if not waited_on or not self.initialized:  # start-up may be slow; the workers'
            return  # own timeout covers a worker 0 that never seeds the servers
        now, timeout = time.monotonic(), self.settings.worker_timeout
        for w in sorted(live):
            silent = now - self._heard.get(w, self._started)
            allowed = timeout if w in self._heard else max(timeout, self.settings.start_timeout)
            if silent <= allowed or any(m.worker == w for _, m in self._waiting):
                continue
            if self.settings.on_worker_loss == "fail":
                self.failure = (f"worker {w} sent nothing for {allowed:.0f}s; the job stops "
                                "(on_worker_loss='fail')")
                for identity, _ in self._waiting:
                    self._reply(identity, -1, error=self.failure)
                self._waiting = []
                return
            self.clocks.dropped.add(w)
            log.warning("parameter server %d: worker %d sent nothing for %.0fs and is dropped "
                        "from the clocks; %d live worker(s) go on", self.index,
                        w, allowed, len(self.clocks.live()))
            self._close_round()

    def _snapshot(self) -> None:
        c = self.clocks
        state = {"settings": self.settings.to_json(), "param": self.param.detach(),
                 "optimizer": self.optimizer.state_dict(), "updates": self.updates,
                 "clocks": {str(w): v for w, v in c.of.items()}, "version": c.version,
                 "dropped": sorted(c.dropped)}
        atomic.save(self.snapshots, self.updates, state, keep_last=2)

    def _restore(self) -> None:
        state = atomic.load(self.snapshots)
        self.settings = Settings.from_json(state["settings"])
        self.param = torch.nn.Parameter(state["param"].clone())
        self.optimizer = self.settings.build_optimizer([self.param])
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = state["updates"]
        self.clocks.of.update({int(w): v for w, v in state["clocks"].items()})
        self.clocks.version = state["version"]
        self.clocks.dropped = set(state["dropped"])
        log.warning("parameter server %d resumed from its snapshot at update %d", self.index,
                    self.updates)
