"""A dead parameter server replaced: a new process takes its slot, copies the slot's
shards from live copies while the workers push, and joins their chains, so that each
shard has its `copies` copies again and the next death is survived the same way.

Servers run as processes of their own (forked with torch imported), the workers as
threads of the test. A server is lost as a process (SIGKILL: its sockets close at once)
or as a machine (a network namespace whose link is cut, then every process in it
killed: nothing tells the others, whose connections' heartbeat finds it, within
HEARTBEAT_TIMEOUT_MS here, 10 s by default); its replacement starts in the same place, or
on a spare machine. With 2 and 3 copies, the
head of shard 0 is lost first, then another server once the chain is whole again.
Counted on every copy at the end: each worker's pushes applied exactly once (a copy made
from another's state counts the pushes in that state: neither lost nor applied twice), and
the run equals one process in sync mode (SGD with momentum), its final weights coming from
the copies that joined.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

from dtrain import ps
from dtrain.ps import chain, link
from dtrain.testing import fork_server
from dtrain.testing.ps_drill import (
    PER_WORKER,
    SECRET,
    SGD,
    WORKERS,
    batch,
    free_binds,
    model,
    numel,
    one_process,
    run_workers,
    server_stats,
)
from tests.support import forked, soak
from tests.support.netns import Host, bridged, ip
from tests.support.poll import until

SUBNET = "10.216.0"
_fixtures = itertools.count()
HEARTBEAT_TIMEOUT_MS = 4000
"""How long a connection to a lost machine's server goes unanswered before it counts as
lost, in the machine drills: the ZeroMQ heartbeat's (dtrain.ps.link, a PING every second),
cut from its 10 s so that each of a drill's two losses waits 4 s for it, not 10. Its
pings are answered by ZeroMQ's own threads, whatever the load on the processes."""


def _serve(index: int, peers: list[str], bind: str, join: bool, netns: str | None) -> None:
    """A server process: slot `index` of the servers at `peers`, bound at `bind`, in
    network namespace `netns` (None: this one's, with the default heartbeat; a machine's,
    with HEARTBEAT_TIMEOUT_MS); with `join`, in place of peers[index]."""
    if netns is not None:
        forked.enter(netns)
        link.HEARTBEAT_TIMEOUT_MS = HEARTBEAT_TIMEOUT_MS
    server = ps.Server(WORKERS, SECRET, numel(model()), index=index, servers=len(peers),
                       bind=bind, join=join)
    server.set_peers(peers)
    server.serve(idle_timeout=60)


@dataclass
class Servers:
    """A job's server processes by slot, and the machines they run on.

    Args:
        n: servers (slots).
        hosts: None: every server on this machine's loopback; else a machine (network
            namespace) per slot, then spare ones, where replacements start in turn.
    """

    n: int
    hosts: list[Host] | None = None
    addresses: list[str] = field(default_factory=list)
    processes: list[Any] = field(default_factory=list)
    where: list[Host | None] = field(default_factory=list)
    spares: int = 0

    def __post_init__(self) -> None:
        for slot in range(self.n):
            host = None if self.hosts is None else self.hosts[slot]
            self.addresses.append(self._bind(host))
            self.where.append(host)
        for slot in range(self.n):
            self.processes.append(self._start(slot, join=False))

    def _bind(self, host: Host | None) -> str:
        """A free address: on loopback, or on `host` (each machine its own ports)."""
        return free_binds(1)[0] if host is None else f"tcp://{host.addr}:30000"

    def _start(self, slot: int, join: bool) -> Any:
        host = self.where[slot]
        process = fork_server().Process(
            target=_serve, args=(slot, list(self.addresses), self.addresses[slot], join,
                                 None if host is None else host.ns))
        process.start()
        return process

    def replace(self, slot: int, machine: bool) -> None:
        """Lose the server in `slot` (its process, or its whole machine) and start a new
        one in its place: on the same machine, or on the next spare one."""
        dead = self.addresses[slot]
        if machine:
            assert self.hosts is not None and self.where[slot] is not None
            lost = self.where[slot]
            ip("-n", lost.ns, "link", "set", lost.ifname, "down")  # nothing leaves it now
            lost.kill_all()
            self.spares += 1
            self.where[slot] = self.hosts[self.n + self.spares - 1]
        else:
            self.processes[slot].kill()
        self.processes[slot].join(30)
        self.addresses[slot] = self._bind(self.where[slot])
        assert self.addresses[slot] != dead
        peers = list(self.addresses)
        peers[slot] = dead
        process = fork_server().Process(
            target=_serve, args=(slot, peers, self.addresses[slot], True,
                                 None if self.where[slot] is None else self.where[slot].ns))
        process.start()
        self.processes[slot] = process

    def stats(self) -> dict[int, dict[str, Any]]:
        """Each live server's counters (its "stats" answer), by slot."""
        return {slot: server_stats(address) for slot, address in enumerate(self.addresses)}

    def whole(self, copies: int) -> bool:
        """Whether every shard's chain has `copies` live copies again, each server of
        it agreeing, every new one joined."""
        for slot, stats in self.stats().items():
            for k in chain.held_by(slot, self.n, copies):
                members = stats["chains"].get(str(k), [])
                if sorted(a for _, a in members) != sorted(
                        self.addresses[s] for s in chain.holders(k, self.n, copies)):
                    return False
                if stats["joined"] is not None and k not in stats["joined"]:
                    return False
        return True

    def wait_whole(self, copies: int, timeout: float) -> None:
        until(lambda: self.whole(copies), timeout, f"every chain back to {copies} copies")

    def join(self) -> None:
        for process in self.processes:
            process.join(30)
            assert process.exitcode == 0


def train_through_losses(settings: ps.Settings, servers: Servers, steps: int,
                         losses: dict[int, int], machine: bool = False,
                         whole_within: float = 60) -> tuple[list[nn.Module], dict]:
    """Both workers train `steps` steps; after worker 0's step s in `losses`, the server
    in slot losses[s] is lost and replaced. Worker 0 waits before step s - 1 until the
    last replacement has joined, so that both workers hear of the new copy in step s - 1's
    answers (the news a head sends unasked could still be on its way when it dies), and
    before the last step, so that the last one joins mid-run too. Returns the models and
    every server's counters at the end, read once the chains are whole again, before the
    workers stop."""
    copies = settings.copies

    def work(rank: int, m: nn.Module) -> ps.Worker:
        worker = ps.Worker(m, settings, list(servers.addresses), rank, SECRET, timeout=60)
        worker.start()
        mine = slice(rank * PER_WORKER, (rank + 1) * PER_WORKER)
        for step in range(steps):
            if rank == 0 and (step + 1 in losses or step == steps - 1):
                servers.wait_whole(copies, whole_within)
            x, y = batch(step)
            nn.functional.cross_entropy(m(x[mine]), y[mine]).backward()
            worker.step()
            if rank == 0 and step in losses:
                servers.replace(losses[step], machine)
        return worker

    models = [model() for _ in range(WORKERS)]
    workers = run_workers(work, models, timeout=60 + whole_within * len(losses))
    servers.wait_whole(copies, whole_within)
    stats = servers.stats()
    for w in workers:
        w.close()
    servers.join()
    return models, stats


def assert_applied_once(stats: dict[int, dict[str, Any]], steps: int, copies: int) -> None:
    """On every copy of every shard: each worker's `steps` pushes applied exactly once
    (those of the state a new copy was made from included), one sync update per step."""
    n = len(stats)
    for slot, server in stats.items():
        for k in chain.held_by(slot, n, copies):
            copy = server["shards"][str(k)]
            assert copy["applied"] == {str(w): steps for w in range(WORKERS)}, (slot, k, copy)
            assert copy["clocks"] == {str(w): steps for w in range(WORKERS)}, (slot, k, copy)
            assert copy["updates"] == steps, (slot, k, copy)


def assert_joined_mid_run(stats: dict[int, dict[str, Any]], replaced: list[int], steps: int,
                          copies: int) -> None:
    """The servers that took a slot in `replaced` copied every shard of it before the end
    (the pushes after that cut came to them as relays), and joined its chains."""
    n = len(stats)
    for slot in replaced:
        shards = chain.held_by(slot, n, copies)
        assert sorted(stats[slot]["joined"]) == sorted(shards), stats[slot]
        for k in shards:
            cut = stats[slot]["shards"][str(k)]["copied_from"]
            assert cut is not None and cut["updates"] < steps, (slot, k, cut)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("copies", "losses"), [(2, {2: 0, 5: 1}), (3, {2: 0, 5: 1})],
                         ids=["2-copies", "3-copies"])
def test_a_killed_server_is_replaced_and_the_next_death_survived(
        copies: int, losses: dict[int, int]) -> None:
    """copies = servers: the server heading shard 0 is SIGKILLed after step 2, a new one
    takes its slot and joins every chain of it while the workers push; once the chains
    are whole, another is killed after step 5 (with 2 copies, the last original one: the
    run ends on the new copies alone), and replaced too. Every push applied once on every
    copy, and sync equals one process."""
    steps = 8
    settings = ps.Settings("sync", copies=copies, **SGD)
    models, stats = train_through_losses(settings, Servers(copies), steps, losses)
    assert_applied_once(stats, steps, copies)
    assert_joined_mid_run(stats, sorted(set(losses.values())), steps, copies)
    for m in models:
        torch.testing.assert_close(m.state_dict(), one_process(steps))


@pytest.mark.slow  # a drill of many kills
@pytest.mark.timeout(120 + 30 * soak.rounds(4, 20))
def test_servers_killed_in_turn_are_replaced_every_time() -> None:
    """3 servers, 2 copies of each shard: a server is SIGKILLed every 2 steps, each slot
    in turn (4 kills here, 20 under make soak), each time replaced once the chains are
    whole again. Every push applied once on every copy; sync equals one process."""
    kills = soak.rounds(4, 20)
    steps = 2 * kills + 2
    losses = {2 * i + 1: i % 3 for i in range(kills)}
    settings = ps.Settings("sync", copies=2, **SGD)
    models, stats = train_through_losses(settings, Servers(3), steps, losses)
    assert_applied_once(stats, steps, 2)
    for m in models:
        torch.testing.assert_close(m.state_dict(), one_process(steps))


# ------------------------------------------------------------------ machines lost
@pytest.fixture
def machines(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Host]]:
    """Five network namespaces on a bridge: three to run servers, two spare ones for
    their replacements. The bridge has an address on the machines' subnet, so the workers
    (threads of this process) reach the servers as another machine would; their
    connections, like the servers', give up on a silent one after HEARTBEAT_TIMEOUT_MS."""
    monkeypatch.setattr(link, "HEARTBEAT_TIMEOUT_MS", HEARTBEAT_TIMEOUT_MS)
    tag = f"{os.getpid() % 10000}{next(_fixtures)}"  # new names for each test
    hosts = [Host(f"dtrain-ps{i}-{tag}", f"dtps{i}{tag}"[:15], f"{SUBNET}.{i + 1}")
             for i in range(5)]
    with bridged(hosts, f"dtpsb{tag}"[:13], SUBNET) as made:
        yield made


@pytest.mark.slow  # waits out the connections' heartbeat twice, by design
@pytest.mark.timeout(240)
@pytest.mark.parametrize("copies", [2, 3])
def test_a_lost_machine_is_replaced_on_another_and_the_next_loss_survived(
        machines: list[Host], copies: int) -> None:
    """A server per machine (copies = servers): the machine of the head of shard 0 is
    lost after step 2 (its link cut, then all its processes killed), a new server on a
    spare machine takes its slot; once the chains are whole, the machine of the server in
    slot 1 is lost after step 5 and replaced on the other spare. Every push applied once
    on every copy, and sync equals one process."""
    steps, losses = 8, {2: 0, 5: 1}
    settings = ps.Settings("sync", copies=copies, **SGD)
    models, stats = train_through_losses(settings, Servers(copies, machines), steps, losses,
                                         machine=True)
    assert_applied_once(stats, steps, copies)
    assert_joined_mid_run(stats, [0, 1], steps, copies)
    for m in models:
        torch.testing.assert_close(m.state_dict(), one_process(steps))
    spares = {f"tcp://{host.addr}:30000" for host in machines[copies:copies + 2]}
    assert {stats[0]["address"], stats[1]["address"]} == spares  # started elsewhere
