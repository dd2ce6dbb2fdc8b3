"""Ranks as real processes on gloo: `run_ranks(fn, n, *args)` runs `fn(*args)` on n ranks
after `dtrain.init()` and returns each rank's result, with a timeout.

    from dtrain.testing import run_ranks

    def total(x):
        t = torch.tensor([float(dtrain.world.current().rank)])
        dtrain.comm.all_reduce(t)
        return t.item()

    run_ranks(total, 3)    # [3.0, 3.0, 3.0]

The calling process hosts the rendezvous store itself on a port the OS picks (so no two
calls race for a port) and its children join it the way ranks under torchrun join the
agent's store. A rank that raises, dies, outlives the timeout, or returns its result and
then fails to exit with status 0 (an abort at exit, a hang in `dtrain.shutdown()`) fails
the call with its rank named. Arguments travel as torch.save bytes, so each rank gets its
own copy (pickled tensors would share memory with the parent and with every other rank).
Ranks are forked from a fork server that imported torch and dtrain once per process, so a
rank starts in milliseconds rather than the seconds an import of torch takes, and they use
gloo unless the call asks for another backend. `fn` must be importable (defined at module
level of an importable module).
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

from dtrain import env as contract


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
            "dtrain.train.trainer", "transformers", "dtrain.testing.processes"]
"""What the fork server imports once, so that a rank starts by fork in milliseconds instead
of importing torch for seconds (a rank's own modules, the caller's, load in the rank).
torch._dynamo too: the first optimizer a process builds imports it (seconds more); the
trainer, which most ranks run; and transformers, which a Hugging Face model's rank would
import for seconds each."""


def fork_server() -> mp.context.ForkServerContext:
    """The fork server's context, started once per process with torch and dtrain
    loaded. Forking the server, not the test process, keeps the ranks clean: the server
    runs no threads and holds no process group, store or CUDA context."""
    ctx = mp.get_context("forkserver")  # typeshed: the ForkServerContext of the overload
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
            "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1",
            **contract.TIMEOUT.pair(collective_timeout),
            # gloo even where CUDA is present (dtrain.init would pick NCCL there): these
            # ranks compute on the CPU; a GPU test asks for NCCL through `env`
            **contract.BACKEND.pair("gloo"),
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
    except BaseException:
        _stop(procs, grace=5)
        raise
    _check_exits(procs, grace=EXIT_GRACE_S)
    return [results[r] for r in range(world_size)]


EXIT_GRACE_S = 30.0
"""How long a rank may take to exit after sending its result: `dtrain.shutdown()` and the
interpreter's exit (a loaded 2-core machine takes seconds)."""


def _stop(procs: list, grace: float) -> None:
    """Let the ranks end within `grace` seconds, then kill what is left."""
    for proc in procs:
        proc.join(timeout=grace)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _check_exits(procs: list, grace: float) -> None:
    """Every rank, its result sent, exits with status 0 within `grace` seconds.

    Raises:
        AssertionError: naming the first rank that hung at exit or exited otherwise.
    """
    deadline = time.monotonic() + grace
    for rank, proc in enumerate(procs):
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            _stop(procs, grace=0)
            raise AssertionError(f"rank {rank} sent its result but did not exit within "
                                 f"{grace:.0f}s (a hang in dtrain.shutdown() or at exit)")
        if proc.exitcode != 0:
            _stop(procs, grace=0)
            raise AssertionError(f"rank {rank} sent its result but exited with code "
                                 f"{proc.exitcode}")
