"""Groups: the ranks a collective runs over, and the transport beneath them.

A `Group` offers point-to-point messages (what dtrain's own algorithms are written with),
the backend's native collectives, a key-value store, and a serial executor. Two kinds:

- `TorchGroup` wraps a `torch.distributed` process group (gloo, NCCL): real processes.
- `ThreadGroup` (dtrain.comm.threads) joins threads of one process through queues, so
  code built on dtrain.comm can be tested in milliseconds (see `dtrain.testing`).

Ordering. Collectives must be issued in the same order on every rank. Native collectives
go to the backend at once, in program order. Algorithms made of point-to-point messages
run on the group's executor, one at a time in submission order: inline when nothing is
queued, otherwise after the queued work, so the messages of two collectives never mix.
"""

from __future__ import annotations

import atexit
import queue
import threading
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dtrain.comm.ops import ReduceOp
from dtrain.errors import DtrainError


class CollectiveTimeout(RuntimeError):
    """A collective could not complete (it waited past the group's timeout, or a peer closed
    its connection); the message names the ranks that never arrived."""


class Handle(Protocol):
    """What an async collective returns: `wait()` blocks until the result is in place."""

    def wait(self) -> object: ...


class Done:
    """A handle that is already complete."""

    def wait(self) -> None:
        return None


class Then:
    """A handle that runs `after` once, when `handle` has completed (e.g. AVG's division)."""

    def __init__(self, handle: Handle, after: Callable[[], object]) -> None:
        self.inner = handle  # what completes the transfer (`on_completion` asks it)
        self._after: Callable[[], object] | None = after

    def wait(self) -> None:
        if self._after is not None:
            self.inner.wait()
            after, self._after = self._after, None
            after()


class Future:
    """A handle completed by the group's executor thread."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] | None = []  # None once set

    def set(self, error: BaseException | None = None) -> None:
        self._error = error
        self._event.set()
        with self._lock:
            callbacks, self._callbacks = self._callbacks or [], None
        for callback in callbacks:
            callback()

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Call `callback` when the job has run (at once if it has), on the executor's
        thread."""
        with self._lock:
            if self._callbacks is not None:
                self._callbacks.append(callback)
                return
        callback()

    def wait(self) -> None:
        self._event.wait()
        if self._error is not None:
            raise self._error


def on_completion(handle: Handle, callback: Callable[[], None]) -> None:
    """Call `callback` once the transfer behind `handle` has completed, from whichever thread
    completes it, without waiting for it (a collective's timeline span notes the instant:
    dtrain.comm.collectives). The handles that can tell: a torch Work (its future), an
    executor's `Future`, `Done`, and a `Then` over one of them; any other never calls it
    (then only the end of its `wait()` bounds the completion)."""
    if isinstance(handle, Then):
        on_completion(handle.inner, callback)
    elif isinstance(handle, Future):
        handle.add_done_callback(callback)
    elif isinstance(handle, Done):
        callback()
    elif isinstance(handle, dist.Work):
        try:
            future = handle.get_future()
        except RuntimeError:  # a backend whose works have no future
            return
        future.add_done_callback(lambda _: callback())


class SerialExecutor:
    """Runs a group's point-to-point jobs one at a time, in the order they were submitted."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.Queue[tuple[Callable[[], object], Future] | None] = queue.Queue()
        self._idle = threading.Condition()
        self._pending = 0
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], object]) -> Future:
        """Queue `job`; the returned future completes (or raises) when it has run."""
        future = Future()
        with self._idle:
            self._pending += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"dtrain-comm-{self._name}")
            self._thread.start()
            atexit.register(self.close)  # also when the world was not started by dtrain
        self._jobs.put((job, future))
        return future

    def run(self, job: Callable[[], object]) -> None:
        """Run `job` now in this thread, after everything already queued."""
        self.drain()
        job()

    def on_worker(self) -> bool:
        """Whether the caller is this executor's own thread (running one of its jobs)."""
        return threading.current_thread() is self._thread

    def drain(self) -> None:
        """Block until all queued jobs have run."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def _loop(self) -> None:
        job: Callable[[], object] | None
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, future = item
            item = error = None
            try:
                job()
            except BaseException as exc:  # handed to whoever waits on the future
                error = exc
            job = None  # the tensors it holds go now, not when the next job comes
            future.set(error)
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def close(self) -> None:
        """Finish queued jobs and stop the thread.

        Joined, not just signalled: a thread still alive when the interpreter finalizes is
        killed mid-call, which aborts the process ("terminate called without an active
        exception") instead of letting it exit with its own status.
        """
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None


class Group:
    """The interface dtrain's collectives need from a transport.

    Attributes:
        rank: this member's index in the group (0..size-1).
        size: number of members.
        name: identical on every member; keys caches and diagnostics.
        backend: "gloo", "nccl", "shm", "shm+torch" or "threads".
        timeout: how long any single wait may block.
        native_blocks: True where `native` does the work itself before it returns (shared
            memory) instead of handing it to a backend: dtrain.comm then runs native
            collectives on the group's executor, like its own algorithms, so that async
            calls still overlap with the caller.
    """

    rank: int
    size: int
    name: str
    backend: str
    timeout: timedelta
    native_blocks = False

    def __init__(self, executor_name: str) -> None:
        self.executor = SerialExecutor(executor_name)
        self.seq = 0  # collectives issued on this group so far (for diagnostics)
        self.traffic: Counter[str] = Counter()  # op -> bytes this rank sent (dtrain.comm.traffic)
        self.cost_models: dict = {}  # op -> algorithm -> cost curve (dtrain.comm.cost)
        self.probed: dict[str, int] = {}  # op -> the largest probe measured here so far, for
        # the ops measured on this group (not loaded or given): dtrain.comm.cost extends them
        self._scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A work buffer shaped like flat `like`, reused between calls.

        Fresh memory of many MB is page-faulted in on first touch at every call; one buffer
        per group, grown to the largest message, avoids that. Only the executor (one job at
        a time) uses it.
        """
        key = (like.dtype, like.device)
        buffer = self._scratch.get(key)
        if buffer is None or buffer.numel() < like.numel():
            buffer = self._scratch[key] = torch.empty(like.numel(), dtype=like.dtype,
                                                      device=like.device)
        return buffer[: like.numel()]

    def release_scratch(self) -> None:
        """Let the work buffers go (after timing probes larger than the real messages)."""
        self._scratch.clear()

    def close(self) -> None:
        """Stop this group's executor (and its sub-groups'); the world is shutting down."""
        self.executor.close()

    def global_rank(self, group_rank: int) -> int:
        raise NotImplementedError

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Handle:
        """Start sending `tensor` to group rank `peer`. Messages between two ranks with the
        same `tag` arrive in the order sent; collectives use tag 0."""
        raise NotImplementedError

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Handle:
        """Start receiving the next message with `tag` from group rank `peer` into `tensor`."""
        raise NotImplementedError

    def native(self, op: str, *args: Any, **kwargs: Any) -> Handle:
        """Start the backend's own collective `op` (names as in dtrain.comm)."""
        raise NotImplementedError

    def store_set(self, key: str, value: str) -> None:
        raise NotImplementedError

    def store_get(self, key: str) -> str | None:
        """The value of `key`, or None if nobody has set it."""
        raise NotImplementedError


class TorchGroup(Group):
    """A `torch.distributed` process group seen through dtrain's Group interface."""

    def __init__(self, pg: dist.ProcessGroup) -> None:
        self._pg: dist.ProcessGroup | None = pg
        self.rank = dist.get_rank(pg)
        self.size = dist.get_world_size(pg)
        self.name = pg.group_name if hasattr(pg, "group_name") else str(id(pg))
        self.backend = dist.get_backend(pg)
        self.timeout = timeout_of(pg)
        super().__init__(self.name)
        self._globals = [dist.get_global_rank(pg, r) for r in range(self.size)]
        self._store: dist.Store | None = None

    @property
    def pg(self) -> dist.ProcessGroup:
        """The torch process group (DtrainError once closed: its world shut down)."""
        if self._pg is None:
            raise DtrainError(f"process group {self.name!r} was closed by dtrain.shutdown()")
        return self._pg

    def close(self) -> None:
        """Stop the executor and let go of the process group.

        A wrapper a script still holds (in a Pipeline, in a layer) must not keep the group
        alive, nor with it gloo's threads, once the world shuts down (dtrain.world.shutdown).
        """
        super().close()
        self._pg = None

    def global_rank(self, group_rank: int) -> int:
        return self._globals[group_rank]

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Handle:
        if self._through_host(tensor):
            host = tensor.detach().cpu()
            sent = dist.isend(host, dst=self._globals[peer], group=self.pg, tag=tag)
            assert sent is not None  # None only for a rank outside the group
            return Then(sent, lambda: host)  # the copy lives until the send completes
        work = dist.isend(tensor, dst=self._globals[peer], group=self.pg, tag=tag)
        assert work is not None  # None only for a rank outside the group
        return work

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Handle:
        if self._through_host(tensor):
            host = torch.empty_like(tensor, device="cpu")
            received = dist.irecv(host, src=self._globals[peer], group=self.pg, tag=tag)
            assert received is not None  # None only for a rank outside the group
            return Then(received, lambda: tensor.copy_(host))
        work = dist.irecv(tensor, src=self._globals[peer], group=self.pg, tag=tag)
        assert work is not None  # None only for a rank outside the group
        return work

    def _through_host(self, tensor: torch.Tensor) -> bool:
        """gloo's point-to-point messages carry host memory only (its collectives take CUDA
        tensors, its send and receive do not): a CUDA tensor goes through a host copy."""
        return self.backend == "gloo" and tensor.is_cuda

    def native(self, op: str, *args: Any, **kwargs: Any) -> Handle:
        return _TORCH_NATIVE[op](self, *args, **kwargs)

    @property
    def below(self) -> TorchGroup:
        """The torch process group's own Group: this one."""
        return self

    def kv(self) -> dist.Store:
        """The job's key-value store (the one every rank joined at init), under a prefix."""
        if self._store is None:
            default = dist.distributed_c10d._get_default_store()
            self._store = dist.PrefixStore("dtrain/comm/", default)
        return self._store

    def store_set(self, key: str, value: str) -> None:
        self.kv().set(key, value)

    def store_get(self, key: str) -> str | None:
        store = self.kv()
        return store.get(key).decode() if store.check([key]) else None


def timeout_of(pg: dist.ProcessGroup | None) -> timedelta:
    """The timeout `pg` was created with (torch keeps it in its backend's options). Groups
    made with dist.new_group get torch's 30 minutes unless given one: pass the world's
    (`dist.group.WORLD`, None before the world starts: then the default below)."""
    if pg is None:
        return timedelta(seconds=180)
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return timedelta(seconds=180)


def _all_reduce(g: TorchGroup, tensor: torch.Tensor, op: ReduceOp) -> Handle:
    return dist.all_reduce(tensor, op=op.to_torch(), group=g.pg, async_op=True)


# torch 2.13 renamed these (the old names warn); torch 2.4 has only the old ones.
_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _all_gather(g: TorchGroup, out: torch.Tensor, tensor: torch.Tensor) -> Handle:
    return _gather_single(out, tensor, group=g.pg, async_op=True)


def _reduce_scatter(g: TorchGroup, out: torch.Tensor, tensor: torch.Tensor, op: ReduceOp) -> Handle:
    return _scatter_single(out, tensor, op=op.to_torch(), group=g.pg, async_op=True)


def _broadcast(g: TorchGroup, tensor: torch.Tensor, root: int) -> Handle:
    return dist.broadcast(tensor, src=g.global_rank(root), group=g.pg, async_op=True)


def _reduce(g: TorchGroup, tensor: torch.Tensor, root: int, op: ReduceOp) -> Handle:
    return dist.reduce(tensor, dst=g.global_rank(root), op=op.to_torch(), group=g.pg,
                       async_op=True)


def _scatter(g: TorchGroup, out: torch.Tensor, chunks: list[torch.Tensor] | None,
             root: int) -> Handle:
    return dist.scatter(out, chunks, src=g.global_rank(root), group=g.pg, async_op=True)


def _gather(g: TorchGroup, tensor: torch.Tensor, chunks: list[torch.Tensor] | None,
            root: int) -> Handle:
    return dist.gather(tensor, chunks, dst=g.global_rank(root), group=g.pg, async_op=True)


def _all_to_all(g: TorchGroup, out: torch.Tensor, tensor: torch.Tensor,
                send: list[int], recv: list[int]) -> Handle:
    return dist.all_to_all_single(out, tensor, output_split_sizes=recv,
                                  input_split_sizes=send, group=g.pg, async_op=True)


def _barrier(g: TorchGroup) -> Handle:
    return dist.barrier(group=g.pg, async_op=True)


_TORCH_NATIVE: dict[str, Callable[..., Handle]] = {
    "all_reduce": _all_reduce, "all_gather": _all_gather, "reduce_scatter": _reduce_scatter,
    "broadcast": _broadcast, "reduce": _reduce, "scatter": _scatter, "gather": _gather,
    "all_to_all": _all_to_all, "barrier": _barrier,
}


class OverTorch(Group):
    """A transport of dtrain's own stacked on a torch group of the same ranks (`below`),
    which carries what the transport does not: point-to-point messages and the store.

    Subclasses implement `native` for the collectives they move themselves.
    """

    def __init__(self, below: TorchGroup, executor_name: str) -> None:
        self.below = below
        self.rank, self.size, self.name = below.rank, below.size, below.name
        self.timeout = below.timeout
        super().__init__(executor_name)

    def close(self) -> None:
        super().close()
        self.below.close()

    def global_rank(self, group_rank: int) -> int:
        return self.below.global_rank(group_rank)

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Handle:
        return self.below.isend(tensor, peer, tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Handle:
        return self.below.irecv(tensor, peer, tag)

    def store_set(self, key: str, value: str) -> None:
        self.below.store_set(key, value)

    def store_get(self, key: str) -> str | None:
        return self.below.store_get(key)

    def run_now(self, job: Callable[[], None]) -> None:
        """Run `job` in this thread, after the work queued on this group (inline when
        called from the group's own executor, whose queue holds the caller itself)."""
        if self.executor.on_worker():
            job()
        else:
            self.executor.run(job)

