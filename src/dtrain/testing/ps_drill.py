"""A parameter-server kill drill, shared by dtrain's tests and its failover benchmark
(benchmarks/ps_failover.py): a small model trained by worker threads on server processes
holding copies of each shard, one server SIGKILLed mid-run or killing itself where a
DTRAIN_FAULT says (dtrain.faults), the survivors' counters read before the workers stop;
and the same steps by one process, to compare against.

    models, stats, resent = train_through_a_kill(ps.Settings("sync", copies=2, **SGD),
                                                 servers=2, victim=0, steps=6, kill_at=2)
    one_process(6)      # the parameters one process reaches on the whole batch
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import zmq
from torch import nn

from dtrain import env, ps
from dtrain.testing.processes import fork_server

SECRET, WORKERS, PER_WORKER = b"job-secret", 2, 4
"""The job's secret, its workers, and the samples each trains on per step."""
SGD: dict[str, Any] = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9}
"""The servers' optimizer (ps.Settings' keywords), and one_process's."""


def model() -> nn.Sequential:
    """The drill's model, the same at every call."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s whole batch (inputs, classes): PER_WORKER samples per worker."""
    g = torch.Generator().manual_seed(step)
    return (torch.randn(WORKERS * PER_WORKER, 6, generator=g),
            torch.randint(0, 3, (WORKERS * PER_WORKER,), generator=g))


def numel(m: nn.Module) -> int:
    """The parameters' elements (a server's size)."""
    return sum(p.numel() for p in m.parameters())


def run_workers(work: Callable[[int, nn.Module], object], models: Sequence[nn.Module],
                timeout: float = 40) -> list:
    """`work(rank, model)` on a thread per worker; the models are built beforehand, as
    threads would race on torch's global seed."""
    n = len(models)
    results: list = [None] * n
    # One step first: a process's first backward is slow (lazy set-up), and a test's short
    # worker_timeout would take a worker busy with it for a silent one.
    warm = model()
    nn.functional.cross_entropy(warm(batch(0)[0]), batch(0)[1]).backward()
    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, work(r, models[r])))
               for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert all(r is not None for r in results), "a worker did not finish"
    return results


def free_binds(n: int) -> list[str]:
    """n loopback addresses with ports free now (for servers in processes of their own)."""
    with zmq.Context() as probe:
        sockets = [probe.socket(zmq.ROUTER) for _ in range(n)]
        binds = [f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}" for s in sockets]
        for s in sockets:
            s.close()
    return binds


def _serve_copy(index: int, binds: list[str], size: int, fault: str) -> None:  # a process
    if fault:  # this process only (DTRAIN_FAULT: dtrain.faults)
        os.environ[env.FAULT.name] = fault
    server = ps.Server(WORKERS, SECRET, size, index=index, servers=len(binds), bind=binds[index])
    server.set_peers(binds)
    server.serve(idle_timeout=30)


def server_stats(address: str) -> dict[str, Any]:
    """A server's counters: per shard copy, the pushes applied per worker and the
    duplicates dropped (its "stats" answer)."""
    with zmq.Context() as context, context.socket(zmq.DEALER) as socket:
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(address)
        socket.send_multipart(ps.pack(SECRET, ps.Message("stats", 0, 0)))
        assert socket.poll(10_000), f"server {address} did not answer stats"
        meta = ps.unpack(SECRET, socket.recv_multipart()).meta
        assert meta is not None, f"server {address} answered stats without its counters"
        return meta


def train_through_a_kill(settings: ps.Settings, servers: int, victim: int, steps: int,
                         kill_at: int | None = None, fault: str = "",
                         how: signal.Signals = signal.SIGKILL
                         ) -> tuple[list[nn.Sequential], dict[int, dict[str, Any]], int]:
    """Workers train `steps` steps on server processes holding 2 copies of each shard;
    server `victim` is sent `how` after worker 0's step `kill_at` (SIGKILL: its sockets
    close at once; SIGSTOP: alive but silent, as a machine that stopped answering, found
    by the connections' heartbeat), or kills itself where the DTRAIN_FAULT `fault` says
    (a push in flight). The survivors' stats are read before the workers stop; a stopped
    victim is SIGKILLed then. Returns the models, {server: stats} and the pushes the
    workers resent."""
    ctx, binds = fork_server(), free_binds(servers)
    processes = [ctx.Process(target=_serve_copy,
                             args=(i, binds, numel(model()), fault if i == victim else ""))
                 for i in range(servers)]
    for p in processes:
        p.start()

    def work(rank: int, m: nn.Module) -> ps.Worker:
        worker = ps.Worker(m, settings, binds, rank, SECRET, timeout=20)
        worker.start()
        mine = slice(rank * PER_WORKER, (rank + 1) * PER_WORKER)
        for step in range(steps):
            x, y = batch(step)
            nn.functional.cross_entropy(m(x[mine]), y[mine]).backward()
            worker.step()
            pid = processes[victim].pid
            if rank == 0 and step == kill_at and pid is not None:  # started: it has one
                os.kill(pid, how)
        return worker

    models = [model() for _ in range(WORKERS)]
    workers = run_workers(work, models)
    stats = {i: server_stats(binds[i]) for i in range(servers) if i != victim}
    processes[victim].kill()  # a stopped one too (a dead one: nothing happens)
    for worker in workers:
        worker.close()
    for i, p in enumerate(processes):
        p.join(10)
        assert p.exitcode == (-signal.SIGKILL if i == victim else 0)
    return models, stats, sum(w.resent_pushes for w in workers)


def one_process(steps: int) -> dict[str, torch.Tensor]:
    """The parameters after `steps` steps of one process on the whole batch (SGD)."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=SGD["lr"], momentum=SGD["momentum"])
    for step in range(steps):
        nn.functional.cross_entropy(m(batch(step)[0]), batch(step)[1]).backward()
        opt.step()
        opt.zero_grad()
    return m.state_dict()
