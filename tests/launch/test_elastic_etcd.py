"""An elastic job (`dtrain train --nnodes 1:3`) whose store is an etcd cluster
(`--rdzv-backend etcd`): a node that leaves and one that joins, as tests/ft/test_elastic.py
drills them on the default store, here with no launcher hosting anything.

A real three-member etcd cluster on loopback (tests.support.etcd_cluster) holds torch's
rendezvous rounds and every key of the job. Three launchers of one rank each stand for
three machines: A and B start together (2 ranks, accumulating 2 batches); after the
checkpoint of step 2, B dies for good and A goes on alone in a new round (accumulating 3)
from that checkpoint; after the checkpoint of step 4, C arrives and A restarts its rank for
a round with C (2 ranks again), from the newest checkpoint, to the end. Each step's loss and
gradient norm, and the final weights, equal one process's on the same global batches (SGD
without clipping: tests.support.cli.EXACT_OPTIMIZER).

One-rank nodes keep the drill to three training processes at a time on a 2-core machine;
what it adds to the default store's test is the rendezvous on etcd, not the re-layout
(the same code for either store). Slow (about a minute); skipped, saying why, where etcd
or python-etcd is not installed.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from tests.ft.test_elastic import CONFIG, checkpointed, launchers, outputs
from tests.models.test_models_train import weights
from tests.store.test_etcd import cluster
from tests.support import forked
from tests.support.cli import EXACT_OPTIMIZER, assert_same_steps, train_rows
from tests.support.etcd_cluster import EtcdCluster
from tests.support.held import release_when_told_to_stop
from tests.support.poll import until

__all__ = ["cluster", "launchers"]  # fixtures this module's test takes

JOB = CONFIG + EXACT_OPTIMIZER
"""The default store's elastic job, with the optimizer of runs compared with one process."""


def start(folder: Path, name: str, endpoints: str, *flags: str,
          fault: str = "") -> forked.Launched:
    """`dtrain train --nnodes 1:3 -n 1` meeting on the etcd cluster at `endpoints`, output
    into `folder/name.out`, forked so that it starts in milliseconds (node B must join
    node A's first round within its last call)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DTRAIN_TIMEOUT": "30",
           "DTRAIN_STALL_TIMEOUT": "0"}
    if fault:
        env["DTRAIN_FAULT"] = fault
    command = ["train", str(folder / "job.toml"), "-n", "1", "--nnodes", "1:3",
               "--rdzv-backend", "etcd", "--rdzv-endpoints", endpoints,
               "--rdzv-id", f"elastic-{folder.name}", "--join-timeout", "60",
               "--set", f"train.out_dir='{folder / 'run'}'",
               "--metrics", str(folder / "metrics.jsonl"), *flags]
    return forked.start(command, env=env, out=folder / f"{name}.out", cwd=folder)


def rounds_kept_in_etcd(cluster: EtcdCluster, run_id: str) -> bool:
    """Whether torch's rendezvous state of `run_id` is in the etcd cluster (where
    dtrain.launch.rendezvous keeps it), so the rounds were met there and nowhere else."""
    import etcd

    host, port = cluster.members[0].endpoint.rsplit(":", 1)
    client = etcd.Client(host=host, port=int(port), read_timeout=5)
    try:
        return bool(client.read(f"/dtrain/rendezvous/{run_id}").value)
    except etcd.EtcdKeyNotFound:
        return False


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_an_elastic_job_on_etcd_goes_from_2_to_1_to_2_nodes_as_one_process_would(
        tmp_path: Path, cluster: EtcdCluster, launchers: list[forked.Launched]) -> None:
    (tmp_path / "job.toml").write_text(JOB)
    want, alone = train_rows(tmp_path / "alone", JOB, ["-n", "1"], steps=8)

    # A is node 0 (its count of ranks sets the accumulation). B's rank (rank 1) holds as
    # step 3 begins in the first round; A's as step 5 begins in the second: each test
    # action lands at a known step.
    a = start(tmp_path, "a", cluster.endpoints, "--node-rank", "0",
              fault="stop@step=5,rank=0,attempt=1")
    launchers.append(a)
    b = start(tmp_path, "b", cluster.endpoints, fault="stop@step=3,rank=1")
    launchers.append(b)
    until(checkpointed(tmp_path, 2), 120, "the checkpoint of step 2",
          running=[a.poll, b.poll], describe=lambda: outputs(tmp_path), every=0.2)
    os.killpg(b.pid, signal.SIGKILL)  # node B dies (its rank dies with its agent)
    b.wait(timeout=30)
    until(checkpointed(tmp_path, 4), 120, "the checkpoint of step 4 by A alone",
          running=[a.poll], describe=lambda: outputs(tmp_path), every=0.2)
    c = start(tmp_path, "c", cluster.endpoints)
    launchers.append(c)
    # A's one rank is held: let it go once A's agent has ended it for the round with C
    release_when_told_to_stop(a, 60, "node A's agent ending its held rank for C",
                              describe=lambda: outputs(tmp_path))
    assert a.wait(timeout=240) == 0, outputs(tmp_path)
    assert c.wait(timeout=60) == 0, outputs(tmp_path)

    text = (tmp_path / "a.out").read_text()
    assert "elastic: 2 of up to 3 ranks; gradient accumulation 2" in text, outputs(tmp_path)
    assert "lost node 1 (rank 1)" in text and "going on without it" in text, text
    assert "elastic: 1 of up to 3 ranks; gradient accumulation 3" in text, text
    checkpoints = tmp_path / "run" / "checkpoints"
    assert f"resumed from {checkpoints / 'step-00000002'} (step 2)" in text, text
    assert f"resumed from {checkpoints / 'step-00000004'} (step 4)" in text, text
    assert text.count("elastic: 2 of up to 3 ranks") == 2, text  # with B, then with C
    assert rounds_kept_in_etcd(cluster, f"elastic-{tmp_path.name}")
    records = map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
    last = {r["step"]: r for r in records if "loss" in r}  # a step run again: its last
    assert_same_steps([last[step] for step in sorted(last)], want)
    torch.testing.assert_close(weights(checkpoints), weights(alone), rtol=1e-4, atol=5e-5)
