"""No silent hangs, no garbage: consistency checks and timeouts that name the rank.

Debug mode (`DTRAIN_DEBUG=1`, or `dtrain run --debug`): before every collective the group
first agrees on (sequence number, operation, dtype, shape, algorithm, reduce op, root).
When a rank differs, every rank raises `CollectiveMismatch` naming that rank and the field
that differs, instead of hanging or returning a wrong result. It costs one small native
all-gather per collective, so it is off by default.

Always on, at no cost until it is needed: when a wait times out, the rank publishes which
collective it is stuck in through the job's store, gives the others a moment to do the
same, and raises `CollectiveTimeout` naming the ranks that never arrived.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from dtrain import env
from dtrain.comm import ops
from dtrain.comm.group import CollectiveTimeout, Group, Handle
from dtrain.comm.ops import AVAILABLE
from dtrain.world import connection_lost

OPS = tuple(AVAILABLE)
ALGORITHMS = ("auto", *ops.ALGORITHMS)
REDUCE_OPS = tuple(op.value for op in ops.ReduceOp)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool)
MAX_DIMS = 8
FIELDS = ("sequence number", "operation", "dtype", "algorithm", "reduce op", "root", "ndim",
          *(f"size of dim {i}" for i in range(MAX_DIMS)))


class CollectiveMismatch(RuntimeError):
    """Ranks called different collectives, or the same one with different arguments."""


def enabled() -> bool:
    return env.DEBUG.get()


def _fingerprint(g: Group, what: str, tensor: torch.Tensor, algorithm: str,
                 details: dict[str, Any]) -> torch.Tensor:
    op = details.get("op")
    # an uneven all_to_all: the ranks' lengths differ by design
    shape = [] if details.get("uneven") else list(tensor.shape)[:MAX_DIMS]
    def code(value: object, table: tuple) -> int:
        return table.index(value) if value in table else -1

    values = [
        g.seq, code(what, OPS), code(tensor.dtype, DTYPES), code(algorithm, ALGORITHMS),
        code(op.value if op is not None else None, REDUCE_OPS), details.get("root", -1),
        1 if details.get("uneven") else tensor.dim(), *shape, *[-1] * (MAX_DIMS - len(shape)),
    ]
    return torch.tensor(values, dtype=torch.int64, device=tensor.device)


def _describe(field: int, value: int) -> str:
    names = {1: OPS, 2: DTYPES, 3: ALGORITHMS, 4: REDUCE_OPS}
    if field in names and 0 <= value < len(names[field]):
        return str(names[field][value])
    return "none" if value == -1 else str(value)


def check(g: Group, what: str, tensor: torch.Tensor, algorithm: str,
          details: dict[str, Any]) -> None:
    """Agree on the call across the group, or raise the same CollectiveMismatch everywhere."""
    mine = _fingerprint(g, what, tensor, algorithm, details)
    everyone = torch.empty(g.size * mine.numel(), dtype=torch.int64, device=mine.device)
    handle = g.native("all_gather", everyone, mine)
    wait_or_diagnose(handle, g, f"{what} (debug check)", g.seq)
    rows = everyone.view(g.size, -1).cpu()
    for rank in range(1, g.size):
        differs = (rows[rank] != rows[0]).nonzero()
        if differs.numel():
            field = int(differs[0])
            raise CollectiveMismatch(
                f"collective #{int(rows[0][0])} on group {g.name!r}: rank {g.global_rank(rank)} "
                f"has {FIELDS[field]} {_describe(field, int(rows[rank][field]))} but rank "
                f"{g.global_rank(0)} has {_describe(field, int(rows[0][field]))} "
                f"(rank {g.global_rank(rank)} called {OPS[int(rows[rank][1])]}, rank "
                f"{g.global_rank(0)} called {OPS[int(rows[0][1])]})"
            )


def _failure(exc: BaseException) -> str | None:
    """Why a collective could not complete, if `exc` says so; None for other errors."""
    text = str(exc).lower()
    if isinstance(exc, TimeoutError) or "timed out" in text or "timeout" in text:
        return "timed out"
    if connection_lost(text):
        # A peer that gave up (its own timeout) or died closes its sockets; whoever waits
        # on it learns that before its own timeout, and still deserves the diagnosis.
        return "failed: a peer closed its connection"
    return None


def wait_or_diagnose(handle: Handle, g: Group, what: str, seq: int) -> None:
    """Wait for `handle`; if it cannot complete (a timeout, or a peer that closed its
    connection), raise CollectiveTimeout naming the missing ranks."""
    try:
        handle.wait()
    except CollectiveTimeout:
        raise
    except (RuntimeError, TimeoutError) as exc:
        failure = _failure(exc)
        if g is None or failure is None:
            raise
        raise CollectiveTimeout(diagnose(g, what, seq, failure)) from exc


def diagnose(g: Group, what: str, seq: int, failure: str = "timed out",
             grace_s: float = 3.0) -> str:
    """Publish where this rank is stuck, read where the others are, and say who is missing."""
    prefix = f"at/{g.name}/"
    if failure == "timed out":
        failure = f"timed out after {g.timeout.total_seconds():.0f}s"
    head = f"{what} #{seq} on group {g.name!r} {failure}"
    seen: dict[int, str | None] = {}
    failed: list[Exception] = []

    def ask() -> None:  # in a thread: a store across a cut network may never answer
        try:
            g.store_set(f"{prefix}{g.rank}", f"{seq} {what}")
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                seen.update({r: g.store_get(f"{prefix}{r}") for r in range(g.size)})
                if all(v is not None for v in seen.values()):
                    break
                time.sleep(0.1)
        except RuntimeError as exc:  # the store itself is gone: the job is coming down
            failed.append(exc)

    asking = threading.Thread(target=ask, name="dtrain-diagnose", daemon=True)
    asking.start()
    asking.join(grace_s + 2.0)
    if failed:
        return f"{head} (the job's store is unreachable: {failed[0]})"
    if asking.is_alive():
        return (f"{head} (the job's store does not answer: the master's machine or the "
                "network to it is down)")
    missing, elsewhere = [], []
    for r, value in seen.items():
        if value is None:
            missing.append(f"rank {g.global_rank(r)} (no report: dead or still computing)")
            continue
        their_seq, _, their_what = value.partition(" ")
        if int(their_seq) < seq:
            missing.append(f"rank {g.global_rank(r)} (stuck in #{value})")
        elif their_what != what:
            elsewhere.append(f"rank {g.global_rank(r)} (in {their_what} #{their_seq})")
    found = []
    if missing:
        found.append(f"never arrived: {', '.join(missing)}")
    if elsewhere:
        found.append(f"called another collective: {', '.join(elsewhere)} (the ranks took "
                     "different code paths; DTRAIN_DEBUG=1 checks every call)")
    return f"{head}; " + ("; ".join(found) if found
                          else "never arrived: none found (every rank reached it: slow network?)")
