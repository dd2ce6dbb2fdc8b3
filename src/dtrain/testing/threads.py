"""Testing distributed code in one process: ranks as threads on the in-process backend.

    from dtrain.testing import run_threads

    def step(rank):
        t = torch.full((4,), float(rank))
        dtrain.comm.all_reduce(t)          # the thread's group is the default world
        return t

    results = run_threads(step, world_size=4)   # [tensor, tensor, tensor, tensor]

Anything built on dtrain.comm (its algorithms, DataParallel) runs unchanged, in
milliseconds, with no ports or processes. A rank that raises fails the call with its rank
named; a collective some rank never joins fails after `timeout` seconds naming it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from dtrain.comm.registry import set_thread_group
from dtrain.comm.threads import Fabric, ThreadGroup


def run_threads(fn: Callable[..., Any], world_size: int, *args: Any,
                timeout: float = 30.0) -> list[Any]:
    """Run `fn(rank, *args)` on `world_size` threads joined by an in-process group.

    Returns each rank's return value, in rank order.

    Raises:
        RuntimeError: a rank raised (the first such rank is named) or did not finish in time.
    """
    fabric = Fabric(world_size, timeout)
    results: list[Any] = [None] * world_size
    errors: dict[int, BaseException] = {}

    def body(rank: int) -> None:
        group = ThreadGroup(fabric, rank, list(range(world_size)))
        set_thread_group(group)
        try:
            results[rank] = fn(rank, *args)
        except BaseException as exc:  # reported below with the rank
            errors[rank] = exc
        finally:
            group.executor.close()
            set_thread_group(None)

    threads = [threading.Thread(target=body, args=(r,), daemon=True, name=f"rank{r}")
               for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 5)
    if errors:
        rank = min(errors)
        raise RuntimeError(f"rank {rank} raised {errors[rank]!r}") from errors[rank]
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if stuck:
        raise RuntimeError(f"ranks {stuck} did not finish within {timeout + 5:.0f}s")
    return results
