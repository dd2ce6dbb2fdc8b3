"""One helper to run a function on N ranks, as real processes on gloo, with a timeout.

The test process hosts the rendezvous store itself on a port the OS picks (so no two tests
race for a port) and its children join it the way ranks under torchrun join the agent's
store. A rank that raises, dies or outlives the timeout fails the test with its rank named.
Arguments travel as torch.save bytes, so each rank gets its own copy (pickled tensors would
share memory with the parent and with every other rank). Ranks are forked from a fork
server that imported torch and dtrain once per session, so a rank starts in milliseconds
rather than the seconds an import of torch takes, and they use gloo unless a test asks
for another backend.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def _child(fn: Callable[..., Any], rank: int, env: dict[str, str], args: bytes, out) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        import dtrain

        dtrain.init()
        result = fn(*torch.load(io.BytesIO(args), weights_only=False))
        buffer = io.BytesIO()
        torch.save(result, buffer)
        out.put((rank, "ok", buffer.getvalue()))
        dtrain.shutdown()
    except BaseException:  # the parent reports it with the rank
        out.put((rank, "error", traceback.format_exc()))


def _check_alive(procs: list, results: dict, deadline: float, timeout: float) -> None:
    for rank, proc in enumerate(procs):
        if rank not in results and proc.exitcode not in (None, 0):
            raise AssertionError(f"rank {rank} died with exit code {proc.exitcode}")
    if time.monotonic() > deadline:
        missing = sorted(set(range(len(procs))) - set(results))
        raise AssertionError(f"ranks {missing} did not finish within {timeout}s")


_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "dtrain", "dtrain.cli",
            "tests.distributed"]
"""What the fork server imports once, so that a rank starts by fork in milliseconds instead
of importing torch for seconds (a rank's own modules, the test's, load in the rank).
torch._dynamo too: the first optimizer a process builds imports it (seconds more)."""


def fork_server() -> mp.context.BaseContext:
    """The fork server's context, started once per test session with torch and dtrain
    loaded. Forking the server, not the test process, keeps the ranks clean: the server
    runs no threads and holds no process group, store or CUDA context."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 90.0,
    collective_timeout: float = 30.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run `fn(*args)` on `world_size` ranks after `dtrain.init()`; return each rank's result.

    `fn` must be importable (defined at module level). Results travel via torch.save.
    """
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(seconds=timeout),
        wait_for_workers=False,
    )
    ctx = fork_server()
    out = ctx.Queue()
    packed = io.BytesIO()
    torch.save(args, packed)
    procs = []
    for rank in range(world_size):
        child_env = {
            "RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "DTRAIN_TIMEOUT": str(collective_timeout), "OMP_NUM_THREADS": "1",
            # gloo even where CUDA is present (dtrain.init would pick NCCL there): these
            # ranks compute on the CPU; a GPU test asks for NCCL through `env`
            "DTRAIN_BACKEND": "gloo",
            **(env or {}),
        }
        proc = ctx.Process(target=_child, args=(fn, rank, child_env, packed.getvalue(), out),
                           daemon=True)
        proc.start()
        procs.append(proc)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            try:
                rank, status, payload = out.get(timeout=0.2)
            except queue.Empty:
                _check_alive(procs, results, deadline, timeout)
                continue
            if status == "error":
                raise AssertionError(f"rank {rank} raised:\n{payload}")
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [results[r] for r in range(world_size)]
