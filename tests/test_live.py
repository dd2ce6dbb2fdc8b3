"""Live replicas (dtrain.parallel.live): a replica that dies or stalls is dropped within the
step, the survivors go on without a restart and end where one process averaging exactly
the participating slices ends; a replacement is sent the state by a live peer and the
group grows back, with no step lost or repeated."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dtrain.config import load_config
from dtrain.errors import ConfigError
from tests.cli import TINY_MODEL

SLOTS = 3
PER_REPLICA = 4
FAST = {"step_timeout": 2.0, "heartbeat_timeout": 1.0}


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(SLOTS * PER_REPLICA, 8, generator=g),
            torch.randint(0, 3, (SLOTS * PER_REPLICA,), generator=g))


def slice_of(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step)
    mine = slice(replica * PER_REPLICA, (replica + 1) * PER_REPLICA)
    return x[mine], y[mine]


def replica_main(port: int, replica: int, plan: dict[str, Any], out: str) -> None:
    """One replica: train plan["steps"] steps on its slice; die where the plan says."""
    import dtrain
    from dtrain.parallel.live import LiveReplicas

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    live = LiveReplicas(store, replica, SLOTS, **plan["timeouts"])
    net = make_model(seed=replica + 1)  # differs per replica: the first quorum aligns them
    model = dtrain.DataParallel(net, live=live, bucket_mb=0.0005)  # one bucket per tensor
    optimizer = make_optimizer(net)
    seen = {"samples": 0}
    live.track(optimizer=optimizer, save_extra=lambda: dict(seen),
               load_extra=lambda extra: seen.update(extra))
    dies = plan.get("victim") == replica and not plan.get("replacement")
    if dies and plan["where"] == "backward":
        def die_in_backward(grad: torch.Tensor) -> None:  # the last layer's bucket is out
            if live.step == plan["at"]:
                os._exit(1)
        net[0].weight.register_hook(die_in_backward)
    ran, finished_at = [], {}
    step = 0
    while step < plan["steps"]:
        step = live.begin_step(step)
        store.set(f"progress/{replica}", str(step))
        if dies and plan["where"] == "before" and step == plan["at"]:
            os._exit(1)
        ran.append(step)
        x, y = slice_of(step, replica)
        parts = plan.get("accum", 1)  # micro-batches, reduced once after the last
        for i, (xs, ys) in enumerate(zip(x.chunk(parts), y.chunk(parts), strict=True)):
            with model.no_sync() if i < parts - 1 else contextlib.nullcontext():
                (nn.functional.cross_entropy(model(xs), ys) / parts).backward()
        if live.committed:
            optimizer.step()
            seen["samples"] += PER_REPLICA * live.size
            finished_at[step] = time.time()
        optimizer.zero_grad()
        time.sleep(plan.get("pace", 0.0))
        step += 1
    live.close()
    torch.save({"params": {k: v.clone() for k, v in net.state_dict().items()},
                "optimizer": optimizer.state_dict(), "history": live.history, "ran": ran,
                "seen": seen["samples"], "finished_at": finished_at}, out)


def simulate(history: dict[int, tuple[int, ...]], steps: int) -> dict[str, torch.Tensor]:
    """One process: each step averages the gradients of exactly the slices that took part."""
    net = make_model(seed=1)  # replica 0's: the first quorum's source
    optimizer = make_optimizer(net)
    for step in range(steps):
        grads = [torch.zeros_like(p) for p in net.parameters()]
        for replica in history[step]:
            net.zero_grad()
            x, y = slice_of(step, replica)
            nn.functional.cross_entropy(net(x), y).backward()
            for total, p in zip(grads, net.parameters(), strict=True):
                total += p.grad
        for total, p in zip(grads, net.parameters(), strict=True):
            p.grad = total / len(history[step])
        optimizer.step()
    return net.state_dict()


class Job:
    """Replica processes around a TCPStore this test process hosts."""

    def __init__(self, tmp: Path, plan: dict[str, Any]) -> None:
        self.tmp, self.plan = tmp, plan
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=30))
        self.spawner = multiprocessing.get_context("forkserver")
        self.spawner.set_forkserver_preload(["torch._dynamo", "dtrain.parallel.data_parallel"])
        self.procs: list[tuple[int, Any, Path]] = []

    def start(self, replica: int, plan: dict[str, Any] | None = None) -> Any:
        out = self.tmp / f"replica-{replica}-{len(self.procs)}.pt"
        proc = self.spawner.Process(target=replica_main, args=(
            self.store.port, replica, plan or self.plan, str(out)), daemon=True)
        proc.start()
        self.procs.append((replica, proc, out))
        return proc

    def progress(self, replica: int) -> int:
        key = f"progress/{replica}"
        return int(self.store.get(key)) if self.store.check([key]) else -1

    def wait_progress(self, replica: int, step: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.progress(replica) < step:
            assert time.monotonic() < deadline, f"replica {replica} never reached step {step}"
            time.sleep(0.01)

    def results(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Results of the processes that exited 0 (joined, in start order)."""
        done = []
        deadline = time.monotonic() + timeout
        for _, proc, out in self.procs:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
            if proc.exitcode == 0:
                done.append(torch.load(out, weights_only=False))
        return done

    def close(self) -> None:
        for _, proc, _ in self.procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.join()


@pytest.fixture
def job_of(tmp_path: Path):
    jobs: list[Job] = []

    def make(plan: dict[str, Any]) -> Job:
        jobs.append(Job(tmp_path, plan))
        return jobs[-1]

    yield make
    for job in jobs:
        job.close()


def assert_matches_simulation(results: list[dict[str, Any]], steps: int) -> None:
    history = results[0]["history"]
    assert sorted(history) == list(range(steps))
    reference = simulate(history, steps)
    for result in results:
        torch.testing.assert_close(result["params"], reference, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["before", "backward"])
def test_survivors_of_a_killed_replica_go_on_and_match_one_process(job_of, where) -> None:
    """Replica 2 dies as step 3 begins (every replica accumulating two micro-batches), or
    in the middle of step 3's backward (after later layers' buckets were launched);
    replicas 0 and 1 finish every step with no restart, average steps 3.. over the two of
    them, and end as one process would."""
    steps = 6
    job = job_of({"steps": steps, "victim": 2, "at": 3, "where": where, "timeouts": FAST,
                  "accum": 2 if where == "before" else 1})
    for replica in range(SLOTS):
        job.start(replica)
    results = job.results()
    assert len(results) == 2
    for result in results:
        assert result["ran"] == list(range(steps))
        counts = [len(result["history"][s]) for s in range(steps)]
        assert counts == [3, 3, 3, 2, 2, 2], counts
    assert all(torch.equal(results[0]["params"][k], results[1]["params"][k])
               for k in results[0]["params"])
    assert_matches_simulation(results, steps)


@pytest.mark.timeout(90)
def test_a_replacement_recovers_from_a_live_peer_and_the_group_grows_back(job_of) -> None:
    """Replica 2 dies as step 3 begins; a new process with id 2 starts once it is gone, is
    sent model, Adam state, step and extra by a live peer, and all three end identical,
    with the step counter continuous and the participants 3,3,3,2,...,2,3,...,3."""
    steps = 14
    job = job_of({"steps": steps, "victim": 2, "at": 3, "where": "before", "pace": 0.2,
                  "timeouts": FAST})
    for replica in range(SLOTS):
        victim = job.start(replica)
    victim.join(30)
    job.start(2, {**job.plan, "replacement": True})
    results = job.results()
    assert len(results) == 3
    survivor, newcomer = results[0], results[2]
    counts = [len(survivor["history"][s]) for s in range(steps)]
    first = newcomer["ran"][0]
    assert 3 < first < steps - 1, newcomer["ran"]
    assert counts == [3] * 3 + [2] * (first - 3) + [3] * (steps - first), counts
    assert newcomer["ran"] == list(range(first, steps))
    assert survivor["ran"] == results[1]["ran"] == list(range(steps))
    for result in results[1:]:
        for key, value in survivor["params"].items():
            assert torch.equal(result["params"][key], value), key
        ours, theirs = survivor["optimizer"]["state"], result["optimizer"]["state"]
        for index in ours:
            for name in ours[index]:
                assert torch.equal(ours[index][name], theirs[index][name]), (index, name)
        assert result["seen"] == survivor["seen"]
    assert_matches_simulation(results, steps)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_stopped_replica_is_dropped_within_the_step_timeout_and_rejoins(job_of) -> None:
    """Replica 2 is SIGSTOPped during step 3: the survivors' step takes at most
    step_timeout (+ slack) longer and they go on without it; continued (SIGCONT), replica 2
    finds itself out of the quorum, recovers from a peer as a joiner and ends identical."""
    steps = 14
    timeouts = FAST
    job = job_of({"steps": steps, "pace": 0.15, "timeouts": timeouts})
    procs = [job.start(replica) for replica in range(SLOTS)]
    job.wait_progress(2, 3)
    os.kill(procs[2].pid, signal.SIGSTOP)
    job.wait_progress(0, 7)
    os.kill(procs[2].pid, signal.SIGCONT)
    results = job.results()
    assert len(results) == 3
    survivor, stopped = results[0], results[2]
    counts = [len(survivor["history"][s]) for s in range(steps)]
    assert counts[:3] == [3, 3, 3] and counts[-1] == 3 and 2 in counts, counts
    dropped = [s for s in range(steps) if len(survivor["history"][s]) == 2]
    gaps = [survivor["finished_at"][s] - survivor["finished_at"][s - 1] for s in dropped]
    assert max(gaps) < timeouts["step_timeout"] + 1.5, gaps
    assert survivor["ran"] == list(range(steps))
    missed = sorted(set(range(steps)) - set(stopped["ran"]))
    assert missed and stopped["ran"] == sorted(stopped["ran"]), stopped["ran"]
    assert stopped["ran"][-1] == steps - 1  # it caught up by recovering, not by replaying
    for key, value in survivor["params"].items():
        assert torch.equal(stopped["params"][key], value), key
    assert_matches_simulation(results[:2], steps)


@pytest.mark.timeout(60)
def test_the_store_keeps_only_the_last_rounds_keys() -> None:
    """A long run does not fill the job's store: the first member deletes each round's
    keys KEEP rounds later (one replica here, in this process)."""
    import dtrain
    from dtrain.parallel.live import LiveReplicas
    from dtrain.parallel.live_rounds import KEEP

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    live = LiveReplicas(store, 0, 1, **FAST)
    net = make_model(seed=1)
    model = dtrain.DataParallel(net, live=live)
    counts = []
    try:
        for step in range(3 * KEEP):
            live.begin_step(step)
            x, y = slice_of(step, 0)
            nn.functional.cross_entropy(model(x), y).backward()
            assert live.committed
            net.zero_grad()
            counts.append(store.num_keys())
    finally:
        live.close()
    rounds = dist.PrefixStore("live/", store)  # as LiveReplicas sees it
    latest = int(rounds.get("latest"))
    assert latest >= 3 * KEEP - 1
    assert rounds.check([f"r/{latest - KEEP + 1}/d", f"r/{latest}/a/0", f"r/{latest}/c0"])
    assert not any(rounds.check([f"r/{g}/{key}"]) for g in (0, KEEP, latest - KEEP)
                   for key in ("d", "a/0", "c0", "v0/0"))
    assert counts[-1] == counts[2 * KEEP] < 2 * counts[KEEP - 1], counts


def test_zero_tensor_and_pipeline_parallel_are_refused_with_live_replicas() -> None:
    load_config(None, ["parallel.fault_tolerance='live'"])
    for key, word in (("zero=2", "zero = 2"), ("tp=2", "tp = 2"), ("pp=2", "pp = 2"),
                      ("mode='ps'", "mode = 'ps'")):
        with pytest.raises(ConfigError, match=f"not parallel.{word}"):
            load_config(None, ["parallel.fault_tolerance='live'", f"parallel.{key}"])


LIVE_JOB = TINY_MODEL + """
[data]
max_bytes = 200000

[train]
steps = 100000
batch_size = 12
eval_every = 0

[parallel]
fault_tolerance = "live"

[logging]
log_every = 100000
sample_tokens = 0
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_dtrain_train_drops_a_killed_replica_and_takes_its_replacement_back(
        tmp_path: Path) -> None:
    """`dtrain train -n 3 --max-restarts 1` with live replicas: replica 2 is SIGKILLed as
    step 5 begins; the other two go on without any restart, its supervisor starts it again,
    and it rejoins from a live peer: the metrics show 3 replicas, then 2, then 3 again, one
    record per step, none skipped or repeated. (The run is long; the test stops it once the
    replacement has taken part in 20 steps.)"""
    config, metrics = tmp_path / "job.toml", tmp_path / "metrics.jsonl"
    config.write_text(LIVE_JOB)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DTRAIN_FAULT": "kill@step=5,rank=2"}
    job = subprocess.Popen(
        [sys.executable, "-m", "dtrain.cli", "train", str(config), "-n", "3",
         "--max-restarts", "1", "--metrics", str(metrics),
         "--set", f"train.out_dir='{tmp_path / 'run'}'"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True)

    def counts() -> list[int]:
        if not metrics.exists():
            return []
        return [json.loads(line)["replicas"] for line in metrics.read_text().splitlines()
                if '"replicas"' in line]

    try:
        deadline = time.monotonic() + 150
        while not (2 in counts() and counts()[-20:] == [3] * 20 and len(counts()) > 30):
            assert job.poll() is None, job.communicate()[0]
            assert time.monotonic() < deadline, f"no rejoin: {counts()[:50]}"
            time.sleep(0.2)
    finally:
        os.killpg(job.pid, signal.SIGINT)
        out = job.communicate(timeout=60)[0]
    seen = counts()
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()
             if '"replicas"' in line]
    assert steps == list(range(1, len(steps) + 1)), steps  # no step lost or repeated
    first_two = seen.index(2)
    assert first_two == 4 and seen[:4] == [3] * 4, seen[:20]  # step 5 averaged 2
    back = first_two + seen[first_two:].index(3)
    assert set(seen[first_two:back]) == {2} and set(seen[back:]) == {3}, seen
    assert "replica 2 was killed by SIGKILL; started again" in out, out
