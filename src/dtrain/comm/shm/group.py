"""The shm backend: collectives between processes of one host through shared memory.

gloo moves every byte through loopback TCP: copies into the kernel and out again, and a
thread hop on each side. Here ranks write into one shared segment and read each other's
data straight from it; reductions are torch ops on views of the segment.

Segment layout (see dtrain.comm.shm.segment for its lifecycle): one flag and one pid per rank,
each on its own cache line, then two slots per rank ("parities") of SLOT bytes each.

Protocol. Every step of every collective is an *epoch*, numbered the same on all ranks:
a rank waits until all flags have reached epoch-1 (so everyone has finished reading the
slots of epoch-2, the parity it is about to overwrite), writes its slot of this epoch's
parity, raises its flag to the epoch (dtrain.comm.shm.flags: the kernel wakes sleepers, none
is lost), and waits for the flags of the ranks whose data it needs. Two parities let a
rank write the next step while slower ranks still read the last one.

- all_reduce, small (at most SMALL bytes): one epoch. Everyone writes its tensor; everyone
  reduces all slots in rank order 0..n-1. Cost: alpha + n*m/B_mem.
- all_reduce, large: in chunks of about SLOT bytes. Everyone writes the others' shards of
  the chunk; rank r reduces shard r (its own part read from its own tensor, the others'
  from their slots, in rank order) into its slot of the next step, which also carries the
  next chunk; then everyone copies the others' reduced shards out. Ranks 0 and 1 reduce in
  place in their own tensor (their part is an operand of the first operation only) and
  then copy the result to their slot, which spares a write to memory the cache lacks. The
  ranks reduce in parallel; each element is reduced by one rank, so all ranks hold
  bitwise-identical results. C chunks take C+1 epochs; per rank about (n-1)/n m written
  in, m read and m/n written by the reduction, m copied back: (C+1) alpha + ~3 m / B_mem.
- reduce_scatter, all_gather, broadcast: one epoch per chunk; barrier: one epoch.
- reduce: all_reduce whose result only the root copies out.
scatter, gather, all_to_all and point-to-point messages (which dtrain's ring, tree and
halving-doubling use) go through the gloo group beneath.

Waiting ranks notice a peer that died (its pid is gone) within about a tenth of a second
and raise CollectiveTimeout naming it; otherwise they give up after the group's timeout.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dtrain import env
from dtrain.comm.group import CollectiveTimeout, Done, Handle, OverTorch, TorchGroup
from dtrain.comm.ops import ReduceOp, combine_, shard_offsets
from dtrain.comm.shm import segment
from dtrain.comm.shm.flags import Flags
from dtrain.errors import DtrainError

SLOT = int(env.SHM_SLOT_MB.get() * 2**20) // 64 * 64
SMALL = 64 << 10  # all_reduce up to this many bytes: one epoch, every rank reduces it all
_LINE = Flags.LINE

_FIRST: dict[ReduceOp, Callable[..., torch.Tensor]] = {
    ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.MAX: torch.maximum,
    ReduceOp.MIN: torch.minimum, ReduceOp.PROD: torch.mul}


def reduce_into(out: torch.Tensor, parts: Sequence[torch.Tensor], op: ReduceOp) -> None:
    """out <- parts[0] (op) parts[1] (op) ... in that order (the same on every rank)."""
    if len(parts) == 1:
        out.copy_(parts[0])
        return
    _FIRST[op](parts[0], parts[1], out=out)
    for part in parts[2:]:
        combine_(out, part, op)


class ShmGroup(OverTorch):
    """Ranks of one host joined by a shared-memory segment.

    Args:
        below: the gloo process group of exactly these ranks; it bootstraps the segment
            and carries what shared memory does not (point-to-point messages, the store).
    """

    backend = "shm"
    native_blocks = True

    def __init__(self, below: TorchGroup) -> None:
        super().__init__(below, f"shm-{below.name}")
        n = self.size
        self._header = -(-2 * n * _LINE // 4096) * 4096
        self._memory = _map_segment(below, self._header + 2 * n * SLOT)
        self._bytes = torch.frombuffer(self._memory, dtype=torch.uint8)
        base = self._bytes.data_ptr()
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        local = int(os.environ.get("LOCAL_WORLD_SIZE", n))
        self._flags = Flags(base, n, spin=max(n, local) <= cores)
        self._peers = [(ctypes.c_int64.from_address(base + (n + k) * _LINE),
                        ctypes.c_int64.from_address(base + (n + k) * _LINE + 8))
                       for k in range(n)]
        me = self._peers[self.rank]
        me[0].value, me[1].value = os.getpid(), _pid_namespace()
        dist.barrier(group=below.pg)  # every pid written before anyone may check one
        self._epoch = 0
        self._all_seen = 0  # the latest epoch every flag is known to have reached
        self._typed: dict[torch.dtype, list[list[torch.Tensor]]] = {}
        self._what = ""
        self._ops: dict[str, Callable[..., None]] = {
            "all_reduce": self._all_reduce, "reduce": self._reduce, "broadcast": self._broadcast,
            "all_gather": self._all_gather, "reduce_scatter": self._reduce_scatter,
            "barrier": self._barrier,
        }

    def native(self, op: str, *args: Any, **kwargs: Any) -> Handle:
        """Run `op` now (blocking), after the collectives already queued on this group."""
        job = self._ops.get(op)
        if job is None:  # scatter, gather, all_to_all: through gloo
            return self.below.native(op, *args, **kwargs)

        def run() -> None:
            self._what = op
            job(*args, **kwargs)

        self.run_now(run)
        return Done()

    # The protocol -----------------------------------------------------------------------

    def _slots(self, dtype: torch.dtype) -> list[list[torch.Tensor]]:
        """slots[rank][parity] as flat tensors of `dtype`."""
        typed = self._typed.get(dtype)
        if typed is None:
            start = self._header
            typed = self._typed[dtype] = [
                [self._bytes[start + (2 * k + p) * SLOT : start + (2 * k + p + 1) * SLOT]
                 .view(dtype) for p in (0, 1)] for k in range(self.size)
            ]
        return typed

    def _step(self, write: Callable[[int], object] | None, need: Sequence[int] | None) -> int:
        """One epoch: wait for the parity to be free, write, announce, wait for `need`
        (None: every rank). Returns the parity whose slots now hold the data."""
        epoch = self._epoch + 1
        everyone = range(self.size)
        deadline = time.monotonic() + self.timeout.total_seconds()
        if self._all_seen < epoch - 1:
            self._flags.wait(everyone, epoch - 1, self._checker(epoch - 1, deadline))
            self._all_seen = epoch - 1
        if write is not None:
            write(epoch & 1)
        self._flags.publish(self.rank, epoch)
        self._flags.wait(everyone if need is None else need, epoch,
                         self._checker(epoch, deadline))
        if need is None:
            self._all_seen = epoch
        self._epoch = epoch
        return epoch & 1

    def _checker(self, epoch: int, deadline: float) -> Callable[[list[int]], None]:
        def check(missing: list[int]) -> None:
            head = f"{self._what} on group {self.name!r} (shm, step {epoch})"
            for k in missing:
                pid, namespace = self._peers[k][0].value, self._peers[k][1].value
                if namespace == _pid_namespace() and not _alive(pid):
                    raise CollectiveTimeout(
                        f"{head}: rank {self.global_rank(k)} (pid {pid}) exited while the "
                        "others waited for it"
                    )
            if time.monotonic() >= deadline:
                who = ", ".join(f"rank {self.global_rank(k)}" for k in missing)
                raise CollectiveTimeout(
                    f"{head} timed out after {self.timeout.total_seconds():.0f}s; never "
                    f"arrived: {who}"
                )

        return check

    # Collectives ------------------------------------------------------------------------

    def _barrier(self) -> None:
        self._step(None, None)

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp, root: int | None = None) -> None:
        flat, n, me = tensor.view(-1), self.size, self.rank
        slots = self._slots(flat.dtype)
        keep = root is None or root == me
        if flat.numel() * flat.element_size() <= min(SMALL, SLOT):
            m = flat.numel()
            p = self._step(lambda p: slots[me][p][:m].copy_(flat), None)
            if keep:
                reduce_into(flat, [slots[k][p][:m] for k in range(n)], op)
            return
        # Pipelined: the step that carries chunk c also carries the reduced shards of
        # chunk c-1, so a message of C chunks takes C+1 steps. A slot holds a raw chunk
        # (`per` elements) and, after it, this rank's reduced shard of the chunk before.
        total = slots[0][0].numel()
        per = total * n // (n + 1)
        starts = list(range(0, flat.numel(), per))
        previous: tuple[torch.Tensor, list[int], int] | None = None  # chunk, offsets, parity
        for c in range(len(starts) + 1):
            chunk = flat[starts[c] : starts[c] + per] if c < len(starts) else None

            def write(q: int, chunk=chunk, previous=previous) -> None:
                if chunk is not None:  # the others' shards of this chunk (mine stays here)
                    off = shard_offsets(chunk.numel(), n)
                    mine = slots[me][q]
                    mine[: off[me]].copy_(chunk[: off[me]])
                    mine[off[me + 1] : chunk.numel()].copy_(chunk[off[me + 1] :])
                if previous is not None:
                    before, off, p = previous
                    lo, hi = off[me], off[me + 1]
                    mine, out = before[lo:hi], slots[me][q][per : per + hi - lo]
                    parts = [mine if k == me else slots[k][p][lo:hi] for k in range(n)]
                    if keep and me < 2:  # in place: `mine` feeds only the first operation
                        reduce_into(mine, parts, op)
                        out.copy_(mine)
                    else:
                        reduce_into(out, parts, op)
                        if keep:
                            mine.copy_(out)

            q = self._step(write, None)
            if previous is not None and keep:
                before, off, _ = previous
                for k in range(n):
                    if k != me:
                        width = off[k + 1] - off[k]
                        before[off[k] : off[k + 1]].copy_(slots[k][q][per : per + width])
            if chunk is not None:
                previous = (chunk, shard_offsets(chunk.numel(), n), q)

    def _reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp) -> None:
        self._all_reduce(tensor, op, root)

    def _broadcast(self, tensor: torch.Tensor, root: int) -> None:
        flat, me = tensor.view(-1), self.rank
        slots = self._slots(flat.dtype)
        per = slots[0][0].numel()
        for start in range(0, max(flat.numel(), 1), per):
            chunk = flat[start : start + per]
            m = chunk.numel()
            write = (lambda p, chunk=chunk, m=m: slots[me][p][:m].copy_(chunk)) if me == root \
                else None
            p = self._step(write, [root])
            if me != root:
                chunk.copy_(slots[root][p][:m])

    def _all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> None:
        flat, n, me = tensor.view(-1), self.size, self.rank
        rows = out.view(n, -1)
        slots = self._slots(flat.dtype)
        per = slots[0][0].numel()
        for start in range(0, flat.numel(), per):
            piece = flat[start : start + per]
            m = piece.numel()
            def write(p: int, piece: torch.Tensor = piece, m: int = m) -> None:
                slots[me][p][:m].copy_(piece)

            p = self._step(write, None)
            for k in range(n):
                rows[k, start : start + m].copy_(slots[k][p][:m])

    def _reduce_scatter(self, out: torch.Tensor, tensor: torch.Tensor, op: ReduceOp) -> None:
        """`tensor` holds n equal shards; `out` gets this rank's, reduced over the ranks."""
        n, me = self.size, self.rank
        width = out.numel()
        rows = tensor.view(n, width)
        slots = self._slots(tensor.dtype)
        per = slots[0][0].numel() // n  # elements of each shard per step
        for start in range(0, width, per):
            m = min(per, width - start)

            def write(p: int, start: int = start, m: int = m) -> None:
                slots[me][p][: n * m].view(n, m).copy_(rows[:, start : start + m])

            p = self._step(write, None)
            reduce_into(out.view(-1)[start : start + m],
                        [slots[k][p][me * m : (me + 1) * m] for k in range(n)], op)


def _map_segment(below: TorchGroup, nbytes: int) -> mmap.mmap:
    """Create (group rank 0) or attach the group's segment; unlink it once all have it."""
    store = below.kv()
    generation = (store.add(f"shm/{below.name}/joined", 1) - 1) // below.size
    key = f"shm/{below.name}/{generation}"
    if below.rank == 0:
        name = segment.new_name(below.name)
        try:
            memory = segment.create(name, nbytes)
        except DtrainError as exc:
            store.set(key, f"error:{exc}")
            raise
        store.set(key, name)
    else:
        name = store.get(key).decode()  # blocks until rank 0 has set it (store timeout)
        if name.startswith("error:"):
            raise DtrainError(name.removeprefix("error:"))
        memory = segment.attach(name, nbytes)
    dist.barrier(group=below.pg)
    if below.rank == 0:
        segment.unlink(name)
    return memory


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a dead child its parent has not reaped yet is a zombie: dead all the same
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0
