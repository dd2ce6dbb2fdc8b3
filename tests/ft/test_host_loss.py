"""No single point of failure: a live job on the etcd store loses whole hosts, rank 0's
first, and goes on.

Three hosts, each a network namespace on a bridge (10.214.0.1-3), each running one member of
a three-member etcd cluster and one launcher of `dtrain train -n 2 --nnodes 3` with live
replicas (six live replicas of one rank). A host is lost as a machine is: every process in
its namespace SIGKILLed at once, its launcher, its ranks and its etcd member. Then:

- the other hosts' launchers name the lost node in one line, and their live replicas take
  their next step without it, with no step lost or repeated (every step recorded once; how
  soon is measured and printed, not bounded: benchmarks/RESULTS.md);
- metrics and checkpoints go on from the new first live replica (rank 0's was on the lost
  host);
- the host comes back (its etcd member restarted on its data, the same `dtrain train`
  command started again) and its launcher takes the lost place, saying so: its live
  replicas recover from a live peer and the steps are averaged over all six again;
- at the end every live replica holds the same weights (their digests, compared by the
  first one): the replacements recovered the state the survivors held.

Hosts are lost in turn, each a different one, KILLS times (1 here: rank 0's host, the
case nothing else covers; 20 under make soak, every host several times). Needs root
(namespaces) and etcd; skipped, saying why, without them. Slow.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dtrain.checkpoint import atomic
from tests.store.test_etcd import LIVE, records
from tests.support import forked, soak
from tests.support.etcd_cluster import EtcdCluster, etcd_binary
from tests.support.netns import Host, bridged
from tests.support.poll import until

pytestmark = pytest.mark.slow

SUBNET = "10.214.0"


@pytest.fixture
def three_hosts(tmp_path: Path) -> Iterator[list[Host]]:
    """Three namespaces on a bridge, loopback up in each; removed after the test, every
    process in them killed first. The bridge is this machine's, with an address of its own
    on the hosts' subnet, so the test reaches the hosts' etcd members as a client would."""
    etcd_binary()
    tag = f"{os.getpid() % 100000}"
    hosts = [Host(f"dtrain-h{i}-{tag}", f"dth{i}{tag}"[:15], f"{SUBNET}.{i + 1}")
             for i in range(3)]
    with bridged(hosts, f"dtbr{tag}", SUBNET) as made:
        yield made


def _launcher(host: Host, node_rank: int, folder: Path, cluster: EtcdCluster, name: str,
              steps: int) -> forked.Launched:
    config = folder / "live.toml"
    if not config.exists():
        config.write_text(LIVE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DTRAIN_TIMEOUT": "30",
           "GLOO_SOCKET_IFNAME": host.ifname}
    proc = forked.start(
        ["train", str(config), "-n", "2", "--nnodes", "3", "--node-rank", str(node_rank),
         "--rdzv-backend", "etcd", "--rdzv-endpoints", cluster.endpoints,
         "--rdzv-id", f"hosts-{folder.name}", "--join-timeout", "90", "--max-restarts", "3",
         # no warm standbys: they replace a rank that died on a live host, and here whole
         # hosts are lost; each would import torch beside the ranks (8 of them, seconds of
         # the 2 cores each, the replacement's start-up and the steps after it slowed)
         "--set", "fault_tolerance.standby=false",
         "--metrics", str(folder / "metrics.jsonl"),
         "--set", f"train.out_dir='{folder / 'run'}'", "--set", f"train.steps={steps}"],
        env=env, out=folder / f"{name}.out", cwd=folder, netns=host.ns)
    host.procs.append(proc)
    return proc


def _newest_checkpoint(folder: Path) -> int:
    listed = atomic.read_index(folder / "run" / "checkpoints")
    return listed[-1]["step"] if listed else 0


def _outputs(folder: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                     for p in sorted(folder.glob("*.out")))


@pytest.mark.timeout(300 + 200 * soak.rounds(1, 20))
def test_losing_any_host_rank_0s_first_loses_no_step(three_hosts: list[Host],
                                                      tmp_path: Path) -> None:
    hosts = three_hosts
    kills = soak.rounds(1, 20)
    # the survivors step on while a replacement starts (its ranks' interpreters and imports,
    # beside them on the 2 cores): about 140 steps on a quiet machine, and the run must
    # still be going when it joins
    steps = 100 + 100 * kills
    cluster = EtcdCluster(tmp_path / "etcd", [h.addr for h in hosts], [h.ns for h in hosts])
    (tmp_path / "etcd").mkdir()
    cluster.start_all()
    metrics = tmp_path / "metrics.jsonl"
    names = [f"h{i}-0" for i in range(len(hosts))]  # each host's launcher output now
    launchers = [_launcher(h, i, tmp_path, cluster, names[i], steps)
                 for i, h in enumerate(hosts)]
    recovered = []  # seconds from each kill to the survivors' next step

    def outputs() -> str:
        return _outputs(tmp_path)

    for kill in range(kills):
        lost = kill % len(hosts)  # host 0 (rank 0's) first, then each in turn
        until(lambda: len(records(metrics)) > 0 and records(metrics)[-1]["live_replicas"] == 6
              and _newest_checkpoint(tmp_path) > 0, 240,
              f"steps of all 6 live replicas before kill {kill}", describe=outputs)
        hosts[lost].signal_all(signal.SIGKILL)  # the machine dies: every process at once
        hosts[lost].kill_all()
        moment = time.time()  # every process of the host is gone from here on
        last = records(metrics)[-1]["step"]  # the steps recorded with it
        until(lambda m=moment: any(r["time"] > m and r["live_replicas"] == 4
                                   for r in records(metrics)), 60,
              f"step by the 4 surviving live replicas after host {lost} was lost (kill "
              f"{kill})", describe=outputs)
        # the survivors' first step without the host (a step of all 6 that was finishing
        # as the host died is not it), no step lost on the way
        after = next(r for r in records(metrics) if r["time"] > moment
                     and r["live_replicas"] == 4)
        recovered.append(after["time"] - moment)
        lost_ranks = f"ranks {2 * lost}-{2 * lost + 1}"
        survivors = [tmp_path / f"{names[i]}.out" for i in range(3) if i != lost]
        line = f"lost node {lost} ({lost_ranks}): no heartbeat from its launcher"
        until(lambda line=line, files=survivors: all(line in f.read_text() for f in files), 30,
              f"the other launchers naming lost node {lost}", describe=outputs)
        assert after["step"] in (last + 1, last + 2), _outputs(tmp_path)
        assert all(r["step"] > last for r in records(metrics) if r["time"] > moment)
        checkpointed = _newest_checkpoint(tmp_path)
        until(lambda c=checkpointed: _newest_checkpoint(tmp_path) > c, 120,
              f"a checkpoint written without host {lost}", describe=outputs)
        cluster.restart(lost)  # the machine comes back, its disk as it was
        names[lost] = f"h{lost}-{kill + 1}"
        back = time.time()  # a step of all 6 that was finishing as the host died is before it
        launchers[lost] = _launcher(hosts[lost], lost, tmp_path, cluster, names[lost], steps)
        until(lambda b=back: any(r["time"] > b and r["live_replicas"] == 6
                                   for r in records(metrics)), 180,
              f"host {lost}'s replacement taking part (kill {kill})", describe=outputs)
        assert f"took the place of lost node {lost} ({lost_ranks}) in the running live job" \
            in (tmp_path / f"{names[lost]}.out").read_text(), outputs()
    # how soon is the benchmark's figure (benchmarks/RESULTS.md), not a bound on 2 loaded
    # cores; that the survivors went on without a restart, and lost no step, is the test's
    print(f"survivors' next step after each kill: {[round(s, 2) for s in recovered]} s")
    codes = [proc.wait(timeout=600) for proc in launchers]
    assert codes == [0, 0, 0], _outputs(tmp_path)
    # each step once; two writers on different hosts (around a change of the first replica)
    # may append theirs out of order
    steps_recorded = sorted(r["step"] for r in records(metrics))
    assert steps_recorded == list(range(1, steps + 1)), _outputs(tmp_path)
    # the replacements recovered the state the survivors held: at the end every live
    # replica's weights equal the first one's (their digests, compared by it)
    assert "dtrain: the 6 live replicas end with the same weights" in outputs(), outputs()
    assert _newest_checkpoint(tmp_path) == steps
    cluster.stop()
