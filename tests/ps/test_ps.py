"""Parameter servers: sync equals one process, async and ssp learn as well, ssp keeps its
bound, forged input is refused, dead workers are dropped, a restarted server resumes."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq
from torch import nn

from dtrain import env, ps
from dtrain.errors import ConfigError, DtrainError
from dtrain.testing import fork_server
from dtrain.testing.ps_drill import (
    PER_WORKER,
    SECRET,
    SGD,
    WORKERS,
    batch,
    model,
    numel,
    one_process,
    run_workers,
    train_through_a_kill,
)
from tests.support.cli import dtrain
from tests.support.paths import EXAMPLES

STEPS = 4
EXAMPLE = str(EXAMPLES / "parameter_server.py")


def start_servers(n: int, workers: int = WORKERS, size: int | None = None,
                  **kwargs) -> list[ps.Server]:
    """n servers of the job's `size` parameters (default: `model()`'s), each serving on a
    thread."""
    size = numel(model()) if size is None else size
    servers = [ps.Server(workers, SECRET, size, index=i, servers=n, **kwargs) for i in range(n)]
    for server in servers:
        server.set_peers([s.address for s in servers])
    for server in servers:
        threading.Thread(target=server.serve, kwargs={"idle_timeout": 30}, daemon=True).start()
    return servers


def train_workers(servers: list[ps.Server], settings: ps.Settings, slow: float = 0.0,
                  overlap: bool = True) -> list[dict]:
    """Every worker on its slice of each global batch; worker 1 sleeps `slow` per step."""

    def work(rank: int, m: nn.Module) -> dict:
        worker = ps.Worker(m, settings, [s.address for s in servers], rank, SECRET,
                           timeout=20, overlap=overlap)
        worker.start()
        mine = slice(rank * PER_WORKER, (rank + 1) * PER_WORKER)
        for step in range(STEPS):
            x, y = batch(step)
            nn.functional.cross_entropy(m(x[mine]), y[mine]).backward()
            if rank == 1:
                time.sleep(slow)
            worker.step()
        worker.close()
        return m.state_dict()

    return run_workers(work, [model() for _ in range(WORKERS)])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("n_servers", "overlap"), [(1, False), (2, True), (3, True)])
def test_sync_equals_one_process(n_servers: int, overlap: bool) -> None:
    """The servers apply the mean of both workers' gradients: one process's SGD with
    momentum on the whole batch, the optimizer state living on the servers."""
    results = train_workers(start_servers(n_servers), ps.Settings("sync", **SGD),
                            overlap=overlap)
    serial = model()
    opt = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        nn.functional.cross_entropy(serial(batch(step)[0]), batch(step)[1]).backward()
        opt.step()
        opt.zero_grad()
    for state in results:
        torch.testing.assert_close(state, serial.state_dict())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staleness", [0, 1])
def test_ssp_never_lets_a_worker_run_more_than_s_clocks_ahead(staleness: int) -> None:
    servers = start_servers(2)
    train_workers(servers, ps.Settings("ssp", staleness, **SGD), slow=0.05)
    for server in servers:
        pulls = [(a.worker, a.clock) for a in server.answered]
        assert sorted(pulls) == [(w, c) for w in range(WORKERS) for c in range(STEPS + 1)]
        assert all(a.clock - a.slowest <= staleness for a in server.answered)
    if staleness:  # the fast worker did use its slack
        assert any(a.clock - a.slowest == staleness for s in servers for a in s.answered)


def digits_accuracy(settings: ps.Settings, epochs: int = 8) -> float:
    """Two workers, one server, an MLP on scikit-learn's handwritten digits; the test
    accuracy after the same number of samples whatever the consistency."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16
    y = torch.tensor(data.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, test = order[:1400], order[1400:]

    def mlp() -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    servers = start_servers(1, size=numel(mlp()))

    def work(rank: int, m: nn.Module) -> float:
        worker = ps.Worker(m, settings, [servers[0].address], rank, SECRET, timeout=20)
        worker.start()
        mine = train[rank::WORKERS]
        for epoch in range(epochs):
            g = torch.Generator().manual_seed(epoch * 10 + rank)
            for idx in mine[torch.randperm(len(mine), generator=g)].split(25):
                nn.functional.cross_entropy(m(x[idx]), y[idx]).backward()
                worker.step()
        worker.close()
        with torch.no_grad():
            return (m(x[test]).argmax(1) == y[test]).float().mean().item()

    return run_workers(work, [mlp() for _ in range(WORKERS)])[0]


@pytest.mark.slow  # about 8 s on 2 cores: make test-slow
@pytest.mark.timeout(90)
def test_async_and_ssp_reach_the_accuracy_of_sync_on_digits() -> None:
    sync = digits_accuracy(ps.Settings("sync", **SGD))
    assert sync > 0.9
    for consistency, staleness in (("async", 0), ("ssp", 2)):
        accuracy = digits_accuracy(ps.Settings(consistency, staleness, **SGD))
        assert accuracy >= sync - 0.02, (consistency, accuracy, sync)


@pytest.mark.timeout(60)
def test_a_worker_with_the_wrong_secret_or_model_is_refused() -> None:
    servers = start_servers(1)
    worker = ps.Worker(model(), ps.Settings(), [servers[0].address], 0, b"not the secret",
                       timeout=5)
    with pytest.raises(DtrainError, match="share the job's secret"):
        worker.start()
    assert list(servers[0].rejected) == ["bad HMAC: not signed with this job's secret"]
    assert not servers[0].initialized
    first = ps.Worker(model(), ps.Settings(), [servers[0].address], 0, SECRET, timeout=5)
    first.start()
    other = ps.Worker(nn.Linear(6, 2), ps.Settings(), [servers[0].address], 1, SECRET, timeout=5)
    with pytest.raises(DtrainError, match="does not match worker 0's"):
        other.start()
    other.close()
    first.close()  # the server's loop ends
    with pytest.raises(ConfigError, match="use one of sync, async, ssp"):
        ps.Settings("eventual")


@pytest.mark.timeout(60)
def test_a_silent_worker_is_dropped_and_the_others_finish() -> None:
    """Worker 1 stops talking after two steps (as a killed process would); in ssp mode
    worker 0 would wait for it forever, but the server drops it after worker_timeout."""
    servers = start_servers(1)
    settings = ps.Settings("ssp", 1, worker_timeout=2.0, **SGD)

    def work(rank: int, m: nn.Module) -> int:
        worker = ps.Worker(m, settings, [servers[0].address], rank, SECRET, timeout=20)
        worker.start()
        for step in range(2 if rank else 6):
            nn.functional.cross_entropy(m(batch(step)[0]), batch(step)[1]).backward()
            worker.step()
        if rank == 0:
            worker.close()
        return worker.clock

    assert run_workers(work, [model() for _ in range(WORKERS)]) == [6, 2]
    assert servers[0].clocks.dropped == {1}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("late", ["first message", "first push"])
def test_a_worker_that_starts_late_is_not_taken_for_a_silent_one(late: str) -> None:
    """Worker 1 sends its first message, or its first push (its first step: the first
    forward and backward, compiling), well after worker_timeout (a slow start on a loaded
    machine) while worker 0 finishes: the silence rule counts start_timeout for it until
    it has pushed a step, so it is not dropped."""
    servers = start_servers(1)
    settings = ps.Settings("async", worker_timeout=2.0, start_timeout=30.0, **SGD)

    def work(rank: int, m: nn.Module) -> int:
        if rank and late == "first message":
            time.sleep(3.0)  # the late start itself is what this test is about
        worker = ps.Worker(m, settings, [servers[0].address], rank, SECRET, timeout=20)
        worker.start()
        if rank and late == "first push":
            time.sleep(3.0)
        for step in range(4):
            nn.functional.cross_entropy(m(batch(step)[0]), batch(step)[1]).backward()
            worker.step()
        worker.close()
        return worker.clock

    assert run_workers(work, [model() for _ in range(WORKERS)]) == [4, 4]
    assert servers[0].clocks.dropped == set()


@pytest.mark.timeout(60)
def test_sync_can_fail_instead_of_going_on_without_a_worker() -> None:
    """Worker 1 registers (its first pull) and falls silent: with on_worker_loss="fail"
    the server stops the job, naming it, once its silence passes the timeout."""
    server = ps.Server(WORKERS, SECRET, numel(model()))
    raised: list[Exception] = []
    thread = threading.Thread(target=lambda: raised.extend(_raises(server.serve)))
    thread.start()
    settings = ps.Settings("sync", worker_timeout=1.0, start_timeout=1.0, on_worker_loss="fail",
                           **SGD)
    m = model()
    worker = ps.Worker(m, settings, [server.address], 0, SECRET, timeout=20)
    worker.start()
    silent = ps.Worker(model(), settings, [server.address], 1, SECRET, timeout=1)
    silent.start()
    nn.functional.cross_entropy(m(batch(0)[0]), batch(0)[1]).backward()
    with pytest.raises(DtrainError, match="worker 1 sent nothing for 1s; the job stops"):
        worker.step()
    thread.join(10)
    assert "worker 1 sent nothing" in str(raised[0])  # the server process exits non-zero
    with pytest.raises(DtrainError, match="did not answer a stop"):
        silent.close()  # its connections closed: the server is gone


def _raises(fn) -> list[Exception]:
    try:
        fn()
    except DtrainError as exc:
        return [exc]
    return []


def _serve(bind: str, snapshots: str) -> None:  # a process of its own, to be killed
    ps.Server(1, SECRET, numel(model()), bind=bind, snapshot_dir=snapshots,
              snapshot_every=1).serve()


@pytest.mark.timeout(90)
def test_a_killed_server_restarts_from_its_snapshot(tmp_path: Path) -> None:
    ctx = fork_server()  # processes of their own, forked with torch and dtrain imported
    with zmq.Context() as probe:  # a free port, to bind the server and its successor on
        socket = probe.socket(zmq.ROUTER)
        bind = f"tcp://127.0.0.1:{socket.bind_to_random_port('tcp://127.0.0.1')}"
        socket.close()
    server = ctx.Process(target=_serve, args=(bind, str(tmp_path)))
    server.start()
    m = model()
    worker = ps.Worker(m, ps.Settings("async", **SGD), [bind], 0, SECRET, timeout=30)
    worker.start()
    for step in range(3):
        nn.functional.cross_entropy(m(batch(step)[0]), batch(step)[1]).backward()
        worker.step()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    server.kill()
    server.join()
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    successor = ctx.Process(target=_serve, args=(bind, str(tmp_path)))
    successor.start()
    worker.pull()  # the same address: ZeroMQ reconnects
    torch.testing.assert_close(m.state_dict(), before)
    assert worker.clock == 3
    nn.functional.cross_entropy(m(batch(3)[0]), batch(3)[1]).backward()
    worker.step()  # and training goes on, momentum included
    worker.close()
    successor.join(10)
    assert successor.exitcode == 0


@pytest.mark.slow  # about 20 s on 2 cores: make test-slow
@pytest.mark.timeout(150)
def test_dtrain_run_starts_servers_and_survives_a_killed_worker() -> None:
    """`dtrain run --servers`: servers need no user code; worker 1 SIGKILLs itself at step
    10 (async), the server drops it, worker 0 finishes and the job succeeds."""
    result = dtrain("run", "-n", "2", "--servers", "1", EXAMPLE, "--consistency",
                    "async", "--die-at-step", "10", "--worker-timeout", "2", "--epochs", "4",
                    timeout=140)
    assert result.returncode == 0, result.stderr
    assert "worker 1 was killed by SIGKILL" in result.stderr
    assert "worker 1 sent nothing for 2s and is dropped from the clocks" in result.stderr
    line = next(x for x in result.stdout.splitlines() if "worker 0: test accuracy" in x)
    assert float(line.split("accuracy ")[1].split()[0]) > 0.9 and "after 112 steps" in line


@pytest.mark.timeout(90)
def test_a_killed_server_loses_no_push_with_a_backup() -> None:
    """copies=2 on 2 servers: server 0 is SIGKILLed mid-run; server 1, holding the other
    copy of its shard, takes over. Every push was applied exactly once on the surviving
    copies (their counters), and sync still equals one process."""
    steps = 8
    models, stats, _ = train_through_a_kill(ps.Settings("sync", copies=2, **SGD), servers=2,
                                            victim=0, steps=steps, kill_at=3)
    survivor = stats[1]
    assert survivor["heads"] == [0, 1]  # it took over shard 0
    for shard in ("0", "1"):
        assert survivor["shards"][shard]["applied"] == {"0": steps, "1": steps}
        assert survivor["shards"][shard]["updates"] == steps  # one sync step per round
    for m in models:
        torch.testing.assert_close(m.state_dict(), one_process(steps))


@pytest.mark.slow  # waits out the heartbeat's 10 s by design
@pytest.mark.timeout(90)
def test_a_stopped_server_is_left_for_its_backup_after_the_heartbeat_timeout() -> None:
    """copies=2 on 2 servers: server 0 is SIGSTOPped mid-run (alive, its sockets open,
    silent: a machine that stopped answering). The workers' heartbeat on its connection
    finds it within 10 s and they go on with server 1: every push applied exactly once on
    the surviving copies, and sync still equals one process."""
    steps = 8
    models, stats, _ = train_through_a_kill(ps.Settings("sync", copies=2, **SGD), servers=2,
                                            victim=0, steps=steps, kill_at=3,
                                            how=signal.SIGSTOP)
    survivor = stats[1]
    assert survivor["heads"] == [0, 1]  # it took over shard 0
    for shard in ("0", "1"):
        assert survivor["shards"][shard]["applied"] == {"0": steps, "1": steps}
        assert survivor["shards"][shard]["updates"] == steps
    for m in models:
        torch.testing.assert_close(m.state_dict(), one_process(steps))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("point", ["push", "relayed"])
def test_a_push_in_flight_when_its_server_dies_is_applied_once(point: str) -> None:
    """copies=2 on 2 servers: server 0 SIGKILLs itself as the first push of clock 3 for
    its shard reaches it, before relaying it (point "push"), or as server 1 acknowledges
    that relayed push, before server 0 acknowledges the worker ("relayed": the backup has
    it, the worker cannot know). The workers resend their unacknowledged pushes with the
    same id to server 1, which applies each exactly once: a resend it already has from the
    relay is counted as a duplicate and dropped. Sync still equals one process."""
    steps = 6
    settings = ps.Settings("sync", copies=2, **SGD)
    models, stats, resent = train_through_a_kill(settings, servers=2, victim=0, steps=steps,
                                                 fault=f"kill@{point}=3,rank=0")
    survivor = stats[1]
    assert survivor["heads"] == [0, 1]
    for shard in ("0", "1"):
        assert survivor["shards"][shard]["applied"] == {"0": steps, "1": steps}
        assert survivor["shards"][shard]["updates"] == steps
    duplicates = survivor["shards"]["0"]["duplicates"]
    assert resent >= 1  # the push that met the fault, at least
    if point == "push":
        # The head died before relaying the push that met the fault: its resend is applied,
        # not dropped. (The other worker's push of clock 2 may have been relayed and not yet
        # acknowledged, its round already applied at the head: its resend is a duplicate.)
        assert duplicates < resent
    else:
        assert 1 <= duplicates <= resent
    assert survivor["shards"]["1"]["duplicates"] == 0  # its head never died
    for m in models:
        torch.testing.assert_close(m.state_dict(), one_process(steps))


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("copies", [2, 1])
def test_dtrain_run_survives_a_killed_server_with_a_backup(copies: int) -> None:
    """`dtrain run -n 2 --servers 2`, server 0 SIGKILLed (DTRAIN_FAULT) as the pushes of
    clock 10 arrive. With 2 copies of each shard the job finishes with exit 0, server 1
    applied each worker's 28 pushes exactly once to both shards, and server 0's launcher
    started a new server 0 (which joined the chains, and then holds the same counts, or
    found the job done first: a start takes seconds, the run not many more); with 1 copy
    the job fails, as before."""
    result = dtrain("run", "-n", "2", "--servers", "2", EXAMPLE, "--copies", str(copies),
                    "--epochs", "1", env={env.FAULT.name: "kill@push=10,rank=0"},
                    timeout=230)
    assert "parameter server 0 was killed by SIGKILL" in result.stderr, result.stderr
    if copies == 1:
        assert result.returncode != 0
        assert "with no backup of its shard" in result.stderr
        assert "error: rank 2 " in result.stderr  # server 0's rank is blamed, not a worker
        return
    assert result.returncode == 0, result.stderr
    assert "a new parameter server 0 starts and joins their chains" in result.stderr
    joined = "parameter server 0 joined the chains of shards [0, 1]" in result.stderr
    assert joined or "parameter server 0: the job's workers are done" in result.stderr
    for server, shard in ((1, 0), (1, 1), *(((0, 0), (0, 1)) if joined else ())):
        # resends it dropped, if any, are not counted as applied
        assert (f"parameter server {server}, shard {shard}: pushes applied per worker "
                "{0: 28, 1: 28}, resends dropped") in result.stderr
    assert result.stdout.count("after 28 steps") == 2
