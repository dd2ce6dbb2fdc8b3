"""A parameter-server worker: pull parameters, compute gradients, push them.

    worker = ps.Worker(model, ps.Settings(consistency="ssp", staleness=2, lr=0.1))
    worker.start()                 # worker 0 seeds the servers; everyone pulls
    for x, y in data:
        loss_fn(model(x), y).backward()   # each server's gradients leave as soon as ready
        worker.step()              # finish the pushes, then pull what the servers allow
    worker.close()

The model's parameters, flattened in order, are cut into one contiguous range per server
(equal lengths, so servers carry equal bytes; a large tensor is split across servers).
Under `dtrain run --servers S` the servers' addresses, this worker's index and the job's
secret come from the launcher; otherwise pass them. With `overlap=True` a hook on every
parameter sends a server its range the moment the last of its gradients is accumulated,
so pushes travel while backward still runs on the layers below.

With `Settings.copies` > 1 every shard has backup copies (dtrain.ps.chain). A worker
watches its connection to each server (dtrain.ps.link); when one drops, it sends what that
server had not answered, and all that follows, to the shard's next copy, which takes over.
A resent push carries the same id (this worker, its clock), so a copy that already has it
acknowledges it without applying it again. Each answer carries the shard's chain as its
head knows it, so a server that joined in a dead one's place (dtrain.ps.server) is known,
and connected to, before the worker needs it.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import zmq
from torch import nn

from dtrain.comm.ops import shard_offsets
from dtrain.errors import ConfigError, DtrainError
from dtrain.ps import job, link
from dtrain.ps.chain import Chain
from dtrain.ps.settings import Settings
from dtrain.ps.wire import BadMessage, Message, pack, unpack


@dataclass
class Request:
    """A request to a shard's head, kept until it is answered (to send it again)."""

    op: str
    tensor: torch.Tensor | None
    meta: dict | None
    to: str  # the address it was sent to


class Worker:
    """One worker's connections to the servers.

    Args:
        model: the module to train; its parameters are replaced by the servers' values
            at `start()` and after every `step()`.
        settings: the job's rules; worker 0's are the ones the servers use.
        servers: the servers' ZeroMQ addresses, in shard order (default: the job's, under
            `dtrain run --servers`).
        rank: this worker's index 0 .. workers-1 (default: the job's).
        secret: the job's shared key (default: the job's).
        timeout: seconds to wait for a server's answer (a pull in sync or ssp mode waits
            for the slowest worker, so leave room for it).
        overlap: push each server's gradients from backward hooks as soon as they are ready.

    Raises:
        DtrainError: no servers given and none found in the job.
        ConfigError: more copies in the settings than servers.
    """

    def __init__(self, model: nn.Module, settings: Settings | None = None,
                 servers: Sequence[str] | None = None, rank: int | None = None,
                 secret: bytes | None = None, timeout: float = 300.0,
                 overlap: bool = True) -> None:
        self.settings = settings or Settings()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._offsets = [0, *itertools.accumulate(p.numel() for p in self.params)]
        self.rank = job.worker_index() if rank is None else rank
        self.servers = (list(servers) if servers is not None
                        else job.server_addresses(self._offsets[-1], publish=self.rank == 0,
                                                 copies=self.settings.copies))
        if self.settings.copies > len(self.servers):
            raise ConfigError(f"copies={self.settings.copies} with {len(self.servers)} "
                              "server(s): each copy of a shard needs a server of its own")
        self.secret = job.secret() if secret is None else secret
        self.clock, self.timeout_ms = 0, int(timeout * 1000)
        bounds = shard_offsets(self._offsets[-1], len(self.servers))
        self.ranges = list(itertools.pairwise(bounds))
        self._context = zmq.Context()
        largest = max(hi - lo for lo, hi in self.ranges)
        self._largest = largest
        self._links: dict[str, tuple[zmq.Socket, zmq.Socket | None]] = {}
        for address in self.servers:
            self._link(address)
        self.chains = [Chain.first(k, self.servers, self.settings.copies)
                       for k in range(len(self.servers))]
        """Each shard's live copies in order, as the servers last said (the first is its
        head)."""
        self.dead: set[str] = set()
        """Addresses of servers whose connection dropped; their shards go to the next copy."""
        self._in_flight: dict[int, Request] = {}
        """shard -> the request sent to its head and not answered yet (to resend)."""
        self.resent_pushes = 0
        """Pushes sent again, with the same id, to the next copy of a shard whose head died
        before acknowledging them."""
        self.sent_bytes = self.received_bytes = 0
        self._accumulating = False
        # a callable giving the lr to send with each push (RemoteOptimizer)
        self.lr_of: Callable[[], float] | None = None
        self._hooks = []
        if overlap:
            self._touches = [self._servers_of(i) for i in range(len(self.params))]
            self._reset_pending()
            self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready(i))
                           for i, p in enumerate(self.params)]

    # ------------------------------------------------------------------ layout
    def _servers_of(self, i: int) -> list[int]:
        lo, hi = self._offsets[i], self._offsets[i + 1]
        return [s for s, (a, b) in enumerate(self.ranges) if a < hi and lo < b]

    def _reset_pending(self) -> None:
        self._pending = [0] * len(self.servers)
        for touched in self._touches:
            for s in touched:
                self._pending[s] += 1

    def _shard(self, s: int, grads: bool) -> torch.Tensor:
        """Server s's range of the flat parameters (or gradients; a missing one is zero)."""
        lo, hi = self.ranges[s]
        parts = []
        for i, p in enumerate(self.params):
            a, b = max(lo, self._offsets[i]), min(hi, self._offsets[i + 1])
            if a >= b:
                continue
            t = p.grad if grads else p.detach()
            flat = torch.zeros(p.numel()) if t is None else t.detach().reshape(-1).float()
            parts.append(flat[a - self._offsets[i] : b - self._offsets[i]])
        return torch.cat(parts) if parts else torch.zeros(0)

    # ------------------------------------------------------------------ messages
    def _link(self, address: str) -> tuple[zmq.Socket, zmq.Socket | None]:
        """The connection to the server at `address` (made at first use: a server that
        joined in a dead one's place is connected to once a chain names it)."""
        if address not in self._links:
            self._links[address] = link.connect(self._context, address, self._largest,
                                                watch=self.settings.copies > 1)
        return self._links[address]

    def _head(self, k: int) -> str:
        head = self.chains[k].head
        if head is None:
            raise DtrainError(f"shard {k} is lost: every server holding a copy of it is gone "
                              f"({', '.join(sorted(self.dead))})")
        return head.address

    def _send(self, k: int, op: str, tensor: torch.Tensor | None = None,
              meta: dict | None = None) -> None:
        """Send `op` about shard k to its head, and remember it until it is answered."""
        head = self._head(k)
        self._in_flight[k] = Request(op, tensor, meta, head)  # the tensor: ZeroMQ sends from it
        message = Message(op, self.rank, self.clock, tensor, meta=meta, shard=k)
        self._link(head)[0].send_multipart(pack(self.secret, message), copy=False)
        self.sent_bytes += 0 if tensor is None else tensor.numel() * tensor.element_size()

    def _lost(self, address: str) -> None:
        """The connection to the server at `address` dropped: resend what it had not
        answered to the next copies of its shards."""
        self.dead.add(address)
        for c in self.chains:
            c.remove({address})
        socket, monitor = self._links.pop(address)
        link.close(socket, monitor)
        self._resend(lambda k: True)

    def _resend(self, which: Callable[[int], bool]) -> None:
        """Send again, to its shard's head now, each request in flight to a server that is
        no longer in its shard's chain, of the shards `which` accepts."""
        for k, r in list(self._in_flight.items()):
            if which(k) and r.to not in self.chains[k].addresses:
                self._send(k, r.op, r.tensor, r.meta)
                self.resent_pushes += r.op == "push"

    def _learn(self, answer: Message) -> None:
        """Take the chain an answer carries as its shard's (less the servers seen gone)."""
        chain = (answer.meta or {}).get("chain")
        if chain is None or answer.shard is None:
            return
        try:
            learned = Chain.from_json(chain)
        except ValueError as exc:
            raise DtrainError(f"a parameter server answered with a malformed chain of shard "
                              f"{answer.shard}: {exc}") from None
        learned.remove(self.dead)
        self.chains[answer.shard] = learned
        # A request sent to a head that the chain no longer lists (gone, and seen so by
        # the head that sent this) goes to the new head.
        self._resend(lambda k: k == answer.shard)

    def _read(self, address: str, op: str) -> Message | None:
        """The answer waiting on the connection to `address` (None: news of a chain,
        taken in, which answers nothing; or a late answer of a server the request was
        taken from, ignored)."""
        try:
            answer = unpack(self.secret, self._links[address][0].recv_multipart(copy=False))
        except BadMessage as exc:
            raise DtrainError(f"cannot read parameter server {address}'s answer to a {op} "
                              f"({exc}): do the workers and servers share the job's "
                              "secret?") from None
        if answer.op == "chain":
            self._learn(answer)
            return None
        asked = self._in_flight.get(answer.shard) if answer.shard is not None else None
        if asked is not None and asked.to != address:
            return None
        if answer.error:
            raise DtrainError(f"parameter server {address} refused a {op}: {answer.error}")
        if answer.shard not in self._in_flight:
            raise DtrainError(f"parameter server {address} answered a {op} about shard "
                              f"{answer.shard}, which was not asked")
        if answer.tensor is not None:
            self.received_bytes += answer.tensor.numel() * answer.tensor.element_size()
        self._learn(answer)
        return answer

    def _collect(self, op: str) -> list[Message]:
        """Every shard's answer to the requests in flight, in shard order; a server that
        goes silent for `timeout` (since it was asked, or since its shard came to it) is
        named."""
        answers: dict[int, Message] = {}
        deadline = time.monotonic() + self.timeout_ms / 1000
        while self._in_flight:
            poller = zmq.Poller()
            asked = {r.to for r in self._in_flight.values()}
            for address in asked:
                for socket in self._links[address]:
                    if socket is not None:
                        poller.register(socket, zmq.POLLIN)
            ready = dict(poller.poll(max(0, int((deadline - time.monotonic()) * 1000))))
            if not ready:
                raise DtrainError(f"parameter server {', '.join(sorted(asked))} did not answer "
                                  f"a {op} within {self.timeout_ms / 1000:.0f}s")
            for address in sorted(asked):
                socket, monitor = self._links[address]
                if socket in ready:
                    answer = self._read(address, op)
                    if answer is None:
                        continue
                    assert answer.shard is not None  # _read checked it was asked
                    answers[answer.shard] = answer
                    del self._in_flight[answer.shard]
                elif monitor is not None and monitor in ready and link.gone(monitor):
                    self._lost(address)
                    deadline = time.monotonic() + self.timeout_ms / 1000
        return [answers[k] for k in sorted(answers)]

    def _exchange(self, op: str) -> list[Message]:
        """Send `op` without a tensor about every shard at once, then collect the answers."""
        for k in range(len(self.servers)):
            self._send(k, op)
        return self._collect(op)

    # ------------------------------------------------------------------ API
    def start(self) -> None:
        """Worker 0 seeds the servers with its model and the settings (a server that
        already holds a shard, e.g. resumed from a snapshot, keeps it); then every worker
        pulls and takes up the clock the servers have for it."""
        if self.rank == 0:
            for k in range(len(self.servers)):
                self._send(k, "init", self._shard(k, grads=False), self.settings.to_json())
            self._collect("init")
        self.pull()

    def _grad_ready(self, i: int):
        def hook(_: torch.Tensor) -> None:
            if self._accumulating:
                return
            for s in self._touches[i]:
                self._pending[s] -= 1
                if self._pending[s] == 0:
                    self._push_to(s)
        return hook

    def _push_to(self, k: int) -> None:
        self._send(k, "push", self._shard(k, grads=True),
                   None if self.lr_of is None else {"lr": self.lr_of()})

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """Backward passes inside add to the gradients without pushing (accumulation);
        the next backward outside, or `push()`, sends the sum."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def push(self) -> None:
        """Send this step's gradients to every server not yet sent to (a missing gradient
        counts as zero), wait for every acknowledgement, and clear the gradients."""
        for k in range(len(self.servers)):
            if k not in self._in_flight:
                self._push_to(k)
        self._collect("push")
        if self._hooks:
            self._reset_pending()
        self.clock += 1
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def pull(self) -> None:
        """Fetch the current parameters into the model (waiting as the consistency says)."""
        answers = self._exchange("pull")
        tensors: list[torch.Tensor] = []
        for a in answers:
            assert a.tensor is not None  # the servers answer a pull with the values
            tensors.append(a.tensor)
        if self.rank != 0:  # worker 0's length was checked by the servers at init
            lengths = [t.numel() for t in tensors]
            if lengths != [hi - lo for lo, hi in self.ranges]:
                raise DtrainError(f"worker {self.rank}'s model does not match worker 0's: the "
                                  f"servers hold shards of {lengths} values, this model "
                                  f"{[hi - lo for lo, hi in self.ranges]}")
        flat = torch.cat(tensors)
        for i, p in enumerate(self.params):
            p.copy_(flat[self._offsets[i] : self._offsets[i + 1]].view_as(p))
        self.clock = max(self.clock, *(a.clock for a in answers))

    def step(self) -> None:
        """push(), then pull(): the parameters for the next step."""
        self.push()
        self.pull()

    def close(self) -> None:
        """Tell the servers this worker is done and close the connections."""
        try:
            self._exchange("stop")
        finally:
            for hook in self._hooks:
                hook.remove()
            for socket, monitor in self._links.values():
                link.close(socket, monitor)
            self._context.term()
