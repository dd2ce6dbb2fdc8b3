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
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence

import torch
import zmq
from torch import nn

from dtrain.comm.ops import shard_offsets
from dtrain.errors import DtrainError
from dtrain.ps import job
from dtrain.ps.settings import Settings
from dtrain.ps.wire import BadMessage, Message, pack, unpack


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
    """

    def __init__(self, model: nn.Module, settings: Settings | None = None,
                 servers: Sequence[str] | None = None, rank: int | None = None,
                 secret: bytes | None = None, timeout: float = 300.0,
                 overlap: bool = True) -> None:
        self.settings = settings or Settings()
        self.servers = list(servers) if servers is not None else job.server_addresses()
        self.rank = job.worker_index() if rank is None else rank
        self.secret = job.secret() if secret is None else secret
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.clock, self.timeout_ms = 0, int(timeout * 1000)
        self._offsets = [0, *itertools.accumulate(p.numel() for p in self.params)]
        bounds = shard_offsets(self._offsets[-1], len(self.servers))
        self.ranges = list(itertools.pairwise(bounds))
        self._context = zmq.Context()
        self._sockets = []
        for address in self.servers:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
            self._sockets.append(socket)
        self.sent_bytes = self.received_bytes = 0
        self._pushed: dict[int, torch.Tensor] = {}  # server -> shard in flight this step
        self._accumulating = False
        self.lr_of = None  # a callable giving the lr to send with each push (RemoteOptimizer)
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
    def _send(self, s: int, op: str, tensor: torch.Tensor | None = None,
              meta: dict | None = None) -> None:
        message = Message(op, self.rank, self.clock, tensor, meta=meta)
        self._sockets[s].send_multipart(pack(self.secret, message), copy=False)
        self.sent_bytes += 0 if tensor is None else tensor.numel() * tensor.element_size()

    def _receive(self, s: int, op: str) -> Message:
        address = self.servers[s]
        if not self._sockets[s].poll(self.timeout_ms):
            raise DtrainError(f"parameter server {address} did not answer a {op} within "
                              f"{self.timeout_ms / 1000:.0f}s")
        try:
            answer = unpack(self.secret, self._sockets[s].recv_multipart(copy=False))
        except BadMessage as exc:
            raise DtrainError(f"cannot read parameter server {address}'s answer to a {op} "
                              f"({exc}): do the workers and servers share the job's "
                              "secret?") from None
        if answer.error:
            raise DtrainError(f"parameter server {address} refused a {op}: {answer.error}")
        if answer.tensor is not None:
            self.received_bytes += answer.tensor.numel() * answer.tensor.element_size()
        return answer

    def _exchange(self, op: str) -> list[Message]:
        """Send `op` without a tensor to every server at once, then collect the answers."""
        for s in range(len(self.servers)):
            self._send(s, op)
        return [self._receive(s, op) for s in range(len(self.servers))]

    # ------------------------------------------------------------------ API
    def start(self) -> None:
        """Worker 0 seeds the servers with its model and the settings (a server that
        already holds a shard, e.g. resumed from a snapshot, keeps it); then every worker
        pulls and takes up the clock the servers have for it."""
        if self.rank == 0:
            for s in range(len(self.servers)):
                self._send(s, "init", self._shard(s, grads=False), self.settings.to_json())
            for s in range(len(self.servers)):
                self._receive(s, "init")
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

    def _push_to(self, s: int) -> None:
        shard = self._shard(s, grads=True)
        self._pushed[s] = shard  # kept alive: ZeroMQ sends from its memory
        self._send(s, "push", shard, None if self.lr_of is None else {"lr": self.lr_of()})

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
        for s in range(len(self.servers)):
            if s not in self._pushed:
                self._push_to(s)
        for s in range(len(self.servers)):
            self._receive(s, "push")
        self._pushed.clear()
        if self._hooks:
            self._reset_pending()
        self.clock += 1
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def pull(self) -> None:
        """Fetch the current parameters into the model (waiting as the consistency says)."""
        answers = self._exchange("pull")
        if self.rank != 0:  # worker 0's length was checked by the servers at init
            lengths = [a.tensor.numel() for a in answers]
            if lengths != [hi - lo for lo, hi in self.ranges]:
                raise DtrainError(f"worker {self.rank}'s model does not match worker 0's: the "
                                  f"servers hold shards of {lengths} values, this model "
                                  f"{[hi - lo for lo, hi in self.ranges]}")
        flat = torch.cat([a.tensor for a in answers])
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
            for socket in self._sockets:
                socket.close()
            self._context.term()
