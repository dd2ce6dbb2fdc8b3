"""dtrain's collective API: one flat function per operation, the same keywords everywhere.

Every function takes `group=` (a torch process group, a dtrain Group, or None for the
world), and where they apply `op=` ("sum", "avg", "max", "min", "prod"), `async_op=` and
`algorithm=` ("auto", "native", "ring", "tree", "halving_doubling"). Synchronous calls
return the result; with `async_op=True` they return a handle whose `wait()` returns it.
Ranks (`src`, `dst`) are ranks within the group. A group of one returns at once.

Shape-changing operations work on the flattened tensor: `reduce_scatter`, `scatter` and
`all_to_all` split it into `size` contiguous shards, the first `numel % size` one element
longer (`dtrain.comm.shard_sizes`), so any length works.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, Literal, TypeVar, overload

import torch

from dtrain import timeline
from dtrain.comm import cost, debug
from dtrain.comm.algorithms import halving_doubling, ring, tree
from dtrain.comm.group import Done, Group, Handle, Then, on_completion
from dtrain.comm.ops import (
    AVAILABLE,
    ReduceOp,
    bus_factor,
    check_held,
    finish_,
    same_place,
    shard_sizes,
    shards,
)
from dtrain.comm.registry import GroupLike, resolve, wrapped_groups
from dtrain.timeline import CommSpan

_TIMED = sys.modules[__name__]  # the calls auto's first choice times: these (dtrain.comm.cost)


PER_RANK_INPUT = ("all_gather", "gather")  # the whole buffer is size x the input

_R = TypeVar("_R")  # what a collective's result is: a tensor, or None (barrier, send)

_waits = threading.local()  # per thread: the in-process backend runs one rank per thread


def waited() -> float:
    """Seconds the calling thread (a rank) has spent blocked in collectives' `wait()`, all
    groups together, since it started: the time it spent waiting for its peers, which a
    step's time less this leaves out (dtrain.train.speed finds the slow rank by it). A
    GPU's collectives block the device, not the host, so there it is what the host waited."""
    return getattr(_waits, "seconds", 0.0)


def traffic(group: GroupLike = None, reset: bool = False) -> dict[str, int]:
    """Bytes this rank has sent on `group` by collective, as a bandwidth-optimal algorithm
    sends them (the whole buffer times `bus_factor`: 2(n-1)/n for all_reduce, (n-1)/n for
    all_gather and reduce_scatter, ...), whatever algorithm ran. `reset` starts over."""
    g = resolve(group)
    counts = dict(g.traffic)
    if reset:
        g.traffic.clear()
    return counts


def sent_total() -> int:
    """Bytes this rank has sent on every process group of its world so far, as `traffic`
    counts them (the metrics' `sent_bytes` per step: the difference across a step)."""
    return sum(sum(g.traffic.values()) for g in wrapped_groups())


class Result(Generic[_R]):
    """Handle of an async collective: `wait()` completes it and returns its result."""

    def __init__(self, handle: Handle, g: Group, what: str, seq: int,
                 finish: Callable[[], _R],
                 span: CommSpan | None = None) -> None:
        self._handle, self._g, self._what, self._seq, self._finish = handle, g, what, seq, finish
        self._span = span  # its timeline span (dtrain.timeline), ended when it completes
        if span is not None:
            on_completion(handle, lambda: _completed(span))

    def wait(self) -> _R:
        begin = time.perf_counter()
        debug.wait_or_diagnose(self._handle, self._g, self._what, self._seq)
        _waits.seconds = waited() + time.perf_counter() - begin
        if self._span is not None:
            _completed(self._span)  # by now at the latest, if the transport did not say
            self._span.end()
            self._span = None
        return self._finish()


def _completed(span: CommSpan) -> None:
    """Note in `span` when its collective completed, once: `completed_us`, microseconds
    after its issue. The span itself ends when the caller waits for it, which for
    DataParallel's buckets is the end of backward whenever the transfer ended: this is
    the instant the transfer did (what tells whether backward hid it)."""
    span.args.setdefault("completed_us", (time.perf_counter_ns() - span.start_ns) / 1e3)


class _Inline:
    """A synchronous point-to-point algorithm: runs (after queued work) when waited on."""

    def __init__(self, g: Group, job: Callable[[], object]) -> None:
        self._g, self._job = g, job

    def wait(self) -> None:
        self._g.executor.run(self._job)


def _run(what: str, g: Group, tensor: torch.Tensor, algorithm: str, async_op: bool,
         native: Callable[[], Handle], algorithms: dict[str, Callable[[], None]],
         finish: Callable[[], _R], **details: Any) -> _R | Result[_R]:
    """Choose the algorithm, check consistency, run it on the right thread, and wait."""
    check_held(tensor, f"{what} on group {g.name!r} (rank {g.rank})")  # gloo: a hang or crash
    g.seq += 1
    whole = tensor.numel() * tensor.element_size() * (g.size if what in PER_RANK_INPUT else 1)
    g.traffic[what] += int(bus_factor(what, g.size) * whole)
    if debug.enabled():  # before choosing: auto's first choice measures, itself collectively
        debug.check(g, what, tensor, algorithm, details)
    name = cost.choose(what, tensor, g, algorithm, AVAILABLE[what], _TIMED)
    if tensor.numel() == 0 and what != "barrier" and not details.get("uneven"):
        # the same length on every rank: nothing to send
        return _trivial(finish(), async_op)
    recorder = timeline.recorder()
    span = None if recorder is None else recorder.begin_comm(what, whole, name, g.size, async_op)
    if name == "native" and not g.native_blocks:
        handle = native()
    else:
        job = algorithms[name] if name != "native" else lambda: native().wait()
        handle = g.executor.submit(job) if async_op else _Inline(g, job)
    result = Result(handle, g, what, g.seq, finish, span)
    return result if async_op else result.wait()


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError("dtrain.comm needs a contiguous tensor: pass tensor.contiguous()")
    return tensor.view(-1)


def _stacked_shape(tensor: torch.Tensor, size: int) -> tuple[int, ...]:
    """Shape of `size` tensors like `tensor` concatenated along dim 0 (scalars: a vector)."""
    return (size * tensor.shape[0], *tensor.shape[1:]) if tensor.dim() else (size,)


def _trivial(value: _R, async_op: bool) -> _R | Result[_R]:
    return Result(Done(), None, "", 0, lambda: value) if async_op else value  # type: ignore[arg-type]


@overload
def all_reduce(tensor: torch.Tensor, op: ReduceOp | str = ..., group: GroupLike = ...,
               async_op: Literal[False] = ..., algorithm: str = ...) -> torch.Tensor: ...
@overload
def all_reduce(tensor: torch.Tensor, op: ReduceOp | str = ..., group: GroupLike = ..., *,
               async_op: Literal[True], algorithm: str = ...) -> Result[torch.Tensor]: ...
@overload
def all_reduce(tensor: torch.Tensor, op: ReduceOp | str = ..., group: GroupLike = ...,
               async_op: bool = ..., algorithm: str = ...
               ) -> torch.Tensor | Result[torch.Tensor]: ...


def all_reduce(tensor: torch.Tensor, op: ReduceOp | str = "sum", group: GroupLike = None,
               async_op: bool = False, algorithm: str = "auto"
               ) -> torch.Tensor | Result[torch.Tensor]:
    """Combine `tensor` across the group, in place on every rank; returns `tensor`.

    Results are bitwise identical on every rank for every algorithm.
    """
    g, op = resolve(group), ReduceOp.parse(op)
    if g.size == 1:
        return _trivial(tensor, async_op)
    flat = _flat(tensor)

    def native() -> Handle:
        return Then(g.native("all_reduce", tensor, op), lambda: finish_(tensor, op, g.size))

    algorithms = {
        "ring": lambda: ring.all_reduce(g, flat, op),
        "tree": lambda: tree.all_reduce(g, flat, op),
        "halving_doubling": lambda: halving_doubling.all_reduce(g, flat, op),
    }
    return _run("all_reduce", g, tensor, algorithm, async_op, native, algorithms,
                lambda: tensor, op=op)


@overload
def broadcast(tensor: torch.Tensor, src: int = ..., group: GroupLike = ...,
              async_op: Literal[False] = ..., algorithm: str = ...) -> torch.Tensor: ...
@overload
def broadcast(tensor: torch.Tensor, src: int = ..., group: GroupLike = ..., *,
              async_op: Literal[True], algorithm: str = ...) -> Result[torch.Tensor]: ...
@overload
def broadcast(tensor: torch.Tensor, src: int = ..., group: GroupLike = ..., async_op: bool = ...,
              algorithm: str = ...) -> torch.Tensor | Result[torch.Tensor]: ...


def broadcast(tensor: torch.Tensor, src: int = 0, group: GroupLike = None,
              async_op: bool = False, algorithm: str = "auto"
              ) -> torch.Tensor | Result[torch.Tensor]:
    """Copy group rank `src`'s `tensor` into every rank's `tensor`; returns `tensor`."""
    g = resolve(group)
    if g.size == 1:
        return _trivial(tensor, async_op)
    flat = _flat(tensor)
    return _run("broadcast", g, tensor, algorithm, async_op,
                lambda: g.native("broadcast", tensor, src),
                {"tree": lambda: tree.broadcast(g, flat, src)}, lambda: tensor, root=src)


@overload
def reduce(tensor: torch.Tensor, dst: int = ..., op: ReduceOp | str = ..., group: GroupLike = ...,
           async_op: Literal[False] = ..., algorithm: str = ...) -> torch.Tensor: ...
@overload
def reduce(tensor: torch.Tensor, dst: int = ..., op: ReduceOp | str = ..., group: GroupLike = ...,
           *, async_op: Literal[True], algorithm: str = ...) -> Result[torch.Tensor]: ...
@overload
def reduce(tensor: torch.Tensor, dst: int = ..., op: ReduceOp | str = ..., group: GroupLike = ...,
           async_op: bool = ..., algorithm: str = ...) -> torch.Tensor | Result[torch.Tensor]: ...


def reduce(tensor: torch.Tensor, dst: int = 0, op: ReduceOp | str = "sum",
           group: GroupLike = None, async_op: bool = False, algorithm: str = "auto"
           ) -> torch.Tensor | Result[torch.Tensor]:
    """Combine `tensor` across the group into rank `dst`'s `tensor` (others' stay as they were)."""
    g, op = resolve(group), ReduceOp.parse(op)
    if g.size == 1:
        return _trivial(tensor, async_op)
    _flat(tensor)
    work = tensor if g.rank == dst else tensor.clone()

    def native() -> Handle:
        handle = g.native("reduce", work, dst, op)
        return Then(handle, lambda: finish_(tensor, op, g.size)) if g.rank == dst else handle

    return _run("reduce", g, tensor, algorithm, async_op, native,
                {"tree": lambda: tree.reduce(g, work.view(-1), dst, op)}, lambda: tensor,
                op=op, root=dst)


@overload
def all_gather(tensor: torch.Tensor, group: GroupLike = ..., async_op: Literal[False] = ...,
               algorithm: str = ..., out: torch.Tensor | None = ...) -> torch.Tensor: ...
@overload
def all_gather(tensor: torch.Tensor, group: GroupLike = ..., *, async_op: Literal[True],
               algorithm: str = ..., out: torch.Tensor | None = ...) -> Result[torch.Tensor]: ...
@overload
def all_gather(tensor: torch.Tensor, group: GroupLike = ..., async_op: bool = ...,
               algorithm: str = ..., out: torch.Tensor | None = ...
               ) -> torch.Tensor | Result[torch.Tensor]: ...


def all_gather(tensor: torch.Tensor, group: GroupLike = None, async_op: bool = False,
               algorithm: str = "auto", out: torch.Tensor | None = None
               ) -> torch.Tensor | Result[torch.Tensor]:
    """Concatenate every rank's `tensor` (same shape everywhere) along dim 0, in rank order.

    `out`: write the result into this tensor (returned) rather than a new one: contiguous,
    of the result's shape and dtype, and apart from `tensor` or `tensor` exactly this
    rank's part of it (an all-gather in place, as NCCL allows and gloo does too: ZeRO
    refills its parameters so, without a copy of the unit or of the shard).

    Raises:
        ValueError: `out` of another shape or dtype, or not contiguous.
    """
    g = resolve(group)
    shape = _stacked_shape(tensor, g.size)
    if out is None:
        out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    elif tuple(out.shape) != shape or out.dtype != tensor.dtype or not out.is_contiguous():
        raise ValueError(f"all_gather(out=): a contiguous {tensor.dtype} tensor of shape "
                         f"{list(shape)} is needed, got {out.dtype} {list(out.shape)}"
                         f"{'' if out.is_contiguous() else ', not contiguous'}")
    if g.size == 1:
        out.copy_(tensor.reshape(shape))
        return _trivial(out, async_op)
    flat_in, flat_out = _flat(tensor), out.view(-1)

    def by_ring() -> None:
        own = shards(flat_out, g.size)[g.rank]
        if not same_place(own, flat_in):  # else in place already
            own.copy_(flat_in)
        ring.all_gather_inplace(g, flat_out)

    return _run("all_gather", g, tensor, algorithm, async_op,
                lambda: g.native("all_gather", flat_out, flat_in), {"ring": by_ring},
                lambda: out)


@overload
def reduce_scatter(tensor: torch.Tensor, op: ReduceOp | str = ..., group: GroupLike = ...,
                   async_op: Literal[False] = ..., algorithm: str = ...) -> torch.Tensor: ...
@overload
def reduce_scatter(tensor: torch.Tensor, op: ReduceOp | str = ..., group: GroupLike = ..., *,
                   async_op: Literal[True], algorithm: str = ...) -> Result[torch.Tensor]: ...
@overload
def reduce_scatter(tensor: torch.Tensor, op: ReduceOp | str = ..., group: GroupLike = ...,
                   async_op: bool = ..., algorithm: str = ...
                   ) -> torch.Tensor | Result[torch.Tensor]: ...


def reduce_scatter(tensor: torch.Tensor, op: ReduceOp | str = "sum", group: GroupLike = None,
                   async_op: bool = False, algorithm: str = "auto"
                   ) -> torch.Tensor | Result[torch.Tensor]:
    """Combine `tensor` across the group; return this rank's shard of the flattened result."""
    g, op = resolve(group), ReduceOp.parse(op)
    flat = _flat(tensor)
    if g.size == 1:
        return _trivial(flat.clone(), async_op)
    sizes = shard_sizes(flat.numel(), g.size)
    width = sizes[0]
    out = torch.empty(width, dtype=tensor.dtype, device=tensor.device)

    def native() -> Handle:
        padded = flat  # equal shards already (ZeRO's units are padded so): no copy
        if flat.numel() != width * g.size:
            padded = torch.zeros(width * g.size, dtype=tensor.dtype, device=tensor.device)
            for r, piece in enumerate(shards(flat, g.size)):
                padded[r * width : r * width + piece.numel()] = piece
        return Then(g.native("reduce_scatter", out, padded, op),
                    lambda: finish_(out, op, g.size))

    def by_ring() -> None:  # on a copy: the ring leaves its input partially reduced
        out[: sizes[g.rank]].copy_(ring.reduce_scatter(g, flat.clone(), op))

    return _run("reduce_scatter", g, tensor, algorithm, async_op, native, {"ring": by_ring},
                lambda: out[: sizes[g.rank]], op=op)


@overload
def scatter(tensor: torch.Tensor, src: int = ..., group: GroupLike = ...,
            async_op: Literal[False] = ..., algorithm: str = ...) -> torch.Tensor: ...
@overload
def scatter(tensor: torch.Tensor, src: int = ..., group: GroupLike = ..., *,
            async_op: Literal[True], algorithm: str = ...) -> Result[torch.Tensor]: ...
@overload
def scatter(tensor: torch.Tensor, src: int = ..., group: GroupLike = ..., async_op: bool = ...,
            algorithm: str = ...) -> torch.Tensor | Result[torch.Tensor]: ...


def scatter(tensor: torch.Tensor, src: int = 0, group: GroupLike = None,
            async_op: bool = False, algorithm: str = "auto") -> torch.Tensor | Result[torch.Tensor]:
    """Give each rank its shard of rank `src`'s flattened `tensor`.

    Every rank passes a tensor of the same shape and dtype; only `src`'s contents matter.
    """
    g = resolve(group)
    flat = _flat(tensor)
    if g.size == 1:
        return _trivial(flat.clone(), async_op)
    sizes = shard_sizes(flat.numel(), g.size)
    out = torch.empty(sizes[0], dtype=tensor.dtype, device=tensor.device)
    chunks = None
    if g.rank == src:
        chunks = [torch.zeros_like(out) for _ in range(g.size)]
        for chunk, piece in zip(chunks, shards(flat, g.size), strict=True):
            chunk[: piece.numel()] = piece
    return _run("scatter", g, tensor, algorithm, async_op,
                lambda: g.native("scatter", out, chunks, src), {},
                lambda: out[: sizes[g.rank]], root=src)


@overload
def gather(tensor: torch.Tensor, dst: int = ..., group: GroupLike = ...,
           async_op: Literal[False] = ..., algorithm: str = ...) -> torch.Tensor | None: ...
@overload
def gather(tensor: torch.Tensor, dst: int = ..., group: GroupLike = ..., *, async_op: Literal[True],
           algorithm: str = ...) -> Result[torch.Tensor | None]: ...
@overload
def gather(tensor: torch.Tensor, dst: int = ..., group: GroupLike = ..., async_op: bool = ...,
           algorithm: str = ...) -> torch.Tensor | None | Result[torch.Tensor | None]: ...


def gather(tensor: torch.Tensor, dst: int = 0, group: GroupLike = None,
           async_op: bool = False, algorithm: str = "auto"
           ) -> torch.Tensor | None | Result[torch.Tensor | None]:
    """Concatenate every rank's `tensor` along dim 0 on rank `dst`; other ranks get None."""
    g = resolve(group)
    shape = _stacked_shape(tensor, g.size)
    out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device) if g.rank == dst else None
    if g.size == 1:
        assert out is not None  # a group of one: this rank is dst
        out.copy_(tensor.reshape(shape))
        return _trivial(out, async_op)
    chunks = list(out.view(g.size, -1).unbind(0)) if out is not None else None
    return _run("gather", g, tensor, algorithm, async_op,
                lambda: g.native("gather", _flat(tensor), chunks, dst), {}, lambda: out,
                root=dst)


@overload
def all_to_all(tensor: torch.Tensor, group: GroupLike = ..., async_op: Literal[False] = ...,
               algorithm: str = ..., send_sizes: list[int] | None = ...,
               recv_sizes: list[int] | None = ...) -> torch.Tensor: ...
@overload
def all_to_all(tensor: torch.Tensor, group: GroupLike = ..., *, async_op: Literal[True],
               algorithm: str = ..., send_sizes: list[int] | None = ...,
               recv_sizes: list[int] | None = ...) -> Result[torch.Tensor]: ...
@overload
def all_to_all(tensor: torch.Tensor, group: GroupLike = ..., async_op: bool = ...,
               algorithm: str = ..., send_sizes: list[int] | None = ...,
               recv_sizes: list[int] | None = ...) -> torch.Tensor | Result[torch.Tensor]: ...


def all_to_all(tensor: torch.Tensor, group: GroupLike = None, async_op: bool = False,
               algorithm: str = "auto", send_sizes: list[int] | None = None,
               recv_sizes: list[int] | None = None) -> torch.Tensor | Result[torch.Tensor]:
    """Send shard j of the flattened `tensor` to rank j; return the shards received, in rank order.

    Even (no sizes): every rank passes the same number of elements, cut as `shard_sizes`
    cuts it; the result has size * shard_sizes[rank]. Uneven: the first send_sizes[0]
    elements go to rank 0, the next send_sizes[1] to rank 1, and so on, and recv_sizes[j]
    elements come from rank j (when not given, the ranks exchange their send sizes first,
    one small all_to_all more); ranks may pass different numbers of elements.
    Algorithms: native (the backend's, what auto runs) or pairwise (size - 1 rounds of
    point-to-point exchanges, rank r sending to r + i and receiving from r - i in round i).

    Raises:
        ValueError: send_sizes or recv_sizes do not have one entry per rank, or
            send_sizes do not add up to the tensor's elements.
    """
    g = resolve(group)
    flat = _flat(tensor)
    if send_sizes is None:
        if recv_sizes is not None:
            raise ValueError("all_to_all: recv_sizes needs send_sizes")
        send = shard_sizes(flat.numel(), g.size)
        recv = [send[g.rank]] * g.size
    else:
        send = [int(n) for n in send_sizes]
        if len(send) != g.size or sum(send) != flat.numel() or min(send) < 0:
            raise ValueError(f"all_to_all: send_sizes {send} must give one count per rank of "
                             f"the group ({g.size}) adding up to the tensor's {flat.numel()} "
                             "elements")
        if recv_sizes is None:
            counts = torch.tensor(send, dtype=torch.int64, device=flat.device)
            recv = all_to_all(counts, group=g).tolist() if g.size > 1 else send
        else:
            recv = [int(n) for n in recv_sizes]
            if len(recv) != g.size:
                raise ValueError(f"all_to_all: recv_sizes {recv} must give one count per "
                                 f"rank of the group ({g.size})")
    if g.size == 1:
        return _trivial(flat.clone(), async_op)
    out = torch.empty(sum(recv), dtype=tensor.dtype, device=tensor.device)

    def pairwise() -> None:
        sent, got = _offsets(send), _offsets(recv)
        out[got[g.rank]:got[g.rank] + recv[g.rank]].copy_(
            flat[sent[g.rank]:sent[g.rank] + send[g.rank]])
        for i in range(1, g.size):
            to, frm = (g.rank + i) % g.size, (g.rank - i) % g.size
            handles = []
            if send[to]:
                handles.append(g.isend(flat[sent[to]:sent[to] + send[to]].clone(), to))
            if recv[frm]:
                piece = torch.empty(recv[frm], dtype=out.dtype, device=out.device)
                handles.append(g.irecv(piece, frm))
            for handle in handles:
                handle.wait()
            if recv[frm]:
                out[got[frm]:got[frm] + recv[frm]].copy_(piece)

    def native() -> Handle:
        if g.backend != "gloo" or (send_sizes is None and min(send)):
            return g.native("all_to_all", out, flat, send, recv)
        # gloo mishandles an empty split (the next message lands in its place, or a size
        # check aborts the process). Any split of the uneven form may be empty, so there
        # (a choice every rank makes alike) every split carries one element more, dropped.
        padded = torch.zeros(flat.numel() + g.size, dtype=flat.dtype, device=flat.device)
        keep = torch.ones_like(padded, dtype=torch.bool)
        keep[torch.tensor(_offsets([n + 1 for n in send])) + torch.tensor(send)] = False
        padded[keep] = flat
        arrived = torch.empty(out.numel() + g.size, dtype=out.dtype, device=out.device)
        ends = torch.tensor(_offsets([n + 1 for n in recv])) + torch.tensor(recv)
        mask = torch.ones_like(arrived, dtype=torch.bool)
        mask[ends] = False
        return Then(g.native("all_to_all", arrived, padded, [n + 1 for n in send],
                             [n + 1 for n in recv]), lambda: out.copy_(arrived[mask]))

    uneven = {"uneven": True} if send_sizes is not None else {}
    # auto is native: pairwise is for an explicit choice, and ranks whose lengths differ
    # must not each decide by measuring on their own
    chosen = "native" if algorithm == "auto" else algorithm
    return _run("all_to_all", g, tensor, chosen, async_op, native,
                {"pairwise": pairwise}, lambda: out, **uneven)


def _offsets(sizes: list[int]) -> list[int]:
    """Where each of consecutive pieces of `sizes` starts."""
    starts, at = [], 0
    for n in sizes:
        starts.append(at)
        at += n
    return starts


@overload
def barrier(group: GroupLike = ..., async_op: Literal[False] = ...) -> None: ...
@overload
def barrier(group: GroupLike = ..., *, async_op: Literal[True]) -> Result[None]: ...
@overload
def barrier(group: GroupLike = ..., async_op: bool = ...) -> None | Result[None]: ...


def barrier(group: GroupLike = None, async_op: bool = False) -> None | Result[None]:
    """Wait until every rank of the group has reached this call."""
    g = resolve(group)
    if g.size == 1:
        return _trivial(None, async_op)
    # Only its metadata is used (the debug fingerprint), on the device NCCL can send.
    token = torch.zeros(1, device="cuda" if g.backend == "nccl" else "cpu")
    return _run("barrier", g, token, "auto", async_op, lambda: g.native("barrier"), {},
                lambda: None)


@overload
def send(tensor: torch.Tensor, dst: int, group: GroupLike = ..., async_op: Literal[False] = ...,
         tag: int = ...) -> None: ...
@overload
def send(tensor: torch.Tensor, dst: int, group: GroupLike = ..., *, async_op: Literal[True],
         tag: int = ...) -> Result[None]: ...
@overload
def send(tensor: torch.Tensor, dst: int, group: GroupLike = ..., async_op: bool = ...,
         tag: int = ...) -> None | Result[None]: ...


def send(tensor: torch.Tensor, dst: int, group: GroupLike = None, async_op: bool = False,
         tag: int = 0) -> None | Result[None]:
    """Send `tensor` to group rank `dst` (which must call `recv` with a same-shaped tensor).
    Messages with the same `tag` between two ranks arrive in the order sent."""
    g = resolve(group)
    span = _p2p_span("send", tensor, dst, g, async_op)
    handle = g.isend(_flat(tensor), dst, tag)
    result = Result(handle, g, f"send to rank {dst}", g.seq, lambda: None, span)
    return result if async_op else result.wait()


@overload
def recv(tensor: torch.Tensor, src: int, group: GroupLike = ..., async_op: Literal[False] = ...,
         tag: int = ...) -> torch.Tensor: ...
@overload
def recv(tensor: torch.Tensor, src: int, group: GroupLike = ..., *, async_op: Literal[True],
         tag: int = ...) -> Result[torch.Tensor]: ...
@overload
def recv(tensor: torch.Tensor, src: int, group: GroupLike = ..., async_op: bool = ...,
         tag: int = ...) -> torch.Tensor | Result[torch.Tensor]: ...


def recv(tensor: torch.Tensor, src: int, group: GroupLike = None, async_op: bool = False,
         tag: int = 0) -> torch.Tensor | Result[torch.Tensor]:
    """Receive into `tensor` the next message with `tag` from group rank `src`; returns
    `tensor`."""
    g = resolve(group)
    span = _p2p_span("recv", tensor, src, g, async_op)
    handle = g.irecv(_flat(tensor), src, tag)
    result = Result(handle, g, f"recv from rank {src}", g.seq, lambda: tensor, span)
    return result if async_op else result.wait()


def _p2p_span(what: str, tensor: torch.Tensor, peer: int, g: Group,
              async_op: bool) -> CommSpan | None:
    """The timeline span of a send or recv (None when no timeline is recorded)."""
    recorder = timeline.recorder()
    if recorder is None:
        return None
    return recorder.begin_comm(what, tensor.numel() * tensor.element_size(), "native", g.size,
                               async_op, peer=peer)
