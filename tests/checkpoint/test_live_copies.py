"""Checkpoint copies between live replicas' hosts (dtrain.checkpoint.live_copies): three
processes stand for three live replicas, each a world of its own on a host of its own (a
folder each), meeting only through the job's store, as live replicas do. The writer's
checkpoints are published on its disk and on the next one's; when another replica becomes
the writer the copies follow it; replicas that share a disk are sent one copy; a resume
after a host's folder is lost, or holds a damaged copy, takes the newest checkpoint on
every replica, fetched from a disk that holds it good.

The whole job: `dtrain train` with live replicas on two launchers, each host its own
folder (slow).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dtrain import env
from dtrain.checkpoint import atomic, universal
from dtrain.checkpoint.copies import HostCopies
from dtrain.checkpoint.live_copies import DISK, LiveCopies
from dtrain.testing import fork_server
from tests.checkpoint.test_fallback import CONFIG
from tests.support.cli import dtrain, train_apart
from tests.train.test_train import model_of

SLOTS = 3
KEEP_LAST = 2


def values(step: int) -> torch.Tensor:
    return torch.randn(6, 5, generator=torch.Generator().manual_seed(step))


def folder_of(root: Path, host: int) -> Path:
    return root / f"host-{host}" / "checkpoints"


def _replica(replica: int, port: int, root: str, host: int, plan: list[tuple[int, int]],
             resume: bool) -> None:
    """Live replica `replica` on host `host` (its folder): keeps copies there; saves the
    steps `plan` gives it ((writer, step) in order: each waits for the one before, posted
    in the store); with `resume`, first resumes and writes what it got into root."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       **env.LIVE_ID.pair(replica), **env.LIVE_SLOTS.pair(SLOTS),
                       **env.RUN_ID.pair("live-copies-test"), "OMP_NUM_THREADS": "1"})
    copies = HostCopies.open(1, host=0)
    assert isinstance(copies, LiveCopies)
    folder = folder_of(Path(root), host)
    copies.keep(folder)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    store.set(f"kept/{replica}", "1")  # (a live job's replicas meet in a quorum before a save)
    store.wait([f"kept/{r}" for r in range(SLOTS)])
    if resume:
        path = copies.resume(folder)
        assert path is not None
        ckpt = universal.Checkpoint(path)
        said = {"path": path, "step": ckpt.step,
                "same": torch.equal(ckpt.tensor("model/w"), values(ckpt.step))}
        (Path(root) / f"resumed-{replica}.json").write_text(json.dumps(said))
    for n, (writer, step) in enumerate(plan):
        if n:
            store.wait([f"saved/{n - 1}"])
        if writer == replica:
            copies.save(folder, step, universal.pieces_of("model/w", values(step)), {},
                        {"step": step}, KEEP_LAST, {"me": torch.tensor([replica])})
            store.set(f"saved/{n}", "1")
    assert copies.keeper is not None
    copies.keeper.leave()  # (dtrain.shutdown's at the end of a rank: waits for the others)


def run(root: Path, hosts: list[int], plan: list[tuple[int, int]], resume: bool = False) -> None:
    """The three replicas (replica r on host hosts[r]) through `plan`; all end well."""
    store = dist.TCPStore("127.0.0.1", 0, SLOTS, is_master=True,
                          timeout=timedelta(seconds=60), wait_for_workers=False)
    procs = [fork_server().Process(target=_replica,
                                   args=(r, store.port, str(root), hosts[r], plan, resume))
             for r in range(SLOTS)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(90)
    codes = [proc.exitcode for proc in procs]
    for proc in procs:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
    assert codes == [0] * SLOTS, codes


def steps_on(root: Path, host: int) -> list[int]:
    return [e["step"] for e in atomic.read_index(folder_of(root, host))]


def disk_order(root: Path, hosts: list[int]) -> list[int]:
    """The hosts in the order copies go round: by their disks' ids."""
    ids = {h: (folder_of(root, h) / DISK).read_text() for h in set(hosts)}
    return sorted(ids, key=ids.__getitem__)


def next_after(order: list[int], host: int) -> int:
    return order[(order.index(host) + 1) % len(order)]


@pytest.mark.timeout(120)
def test_the_writers_checkpoints_are_copied_to_the_next_disk_and_follow_a_new_writer(
        tmp_path: Path) -> None:
    """Replica 0 writes steps 1 and 2, then replica 1 (the first replica changed) writes
    step 3: each checkpoint is published whole on its writer's disk and on the next disk
    (copies = 1), and on no other, keep_last = 2 applied on each disk as checkpoints
    arrive there."""
    hosts = [0, 1, 2]
    run(tmp_path, hosts, [(0, 1), (0, 2), (1, 3)])
    order = disk_order(tmp_path, hosts)
    arrived: dict[int, list[int]] = {h: [] for h in hosts}
    for step, writer in ((1, 0), (2, 0), (3, 1)):
        for h in sorted({writer, next_after(order, writer)}):
            arrived[h].append(step)
    for h in hosts:
        assert steps_on(tmp_path, h) == arrived[h][-KEEP_LAST:], (h, arrived, order)
        for step in steps_on(tmp_path, h):
            writer = 1 if step == 3 else 0
            ckpt = universal.Checkpoint(folder_of(tmp_path, h) / f"step-{step:08d}")
            assert torch.equal(ckpt.tensor("model/w"), values(step))
            assert torch.equal(ckpt.rank_tensors(0)["me"], torch.tensor([writer]))


@pytest.mark.timeout(120)
def test_replicas_sharing_a_disk_get_one_copy(tmp_path: Path) -> None:
    """Replicas 1 and 2 on one host (one folder, one disk id): replica 0's checkpoint is
    copied there once, and the host's folder lists it once."""
    run(tmp_path, [0, 1, 1], [(0, 1)])
    assert (folder_of(tmp_path, 1) / DISK).exists()
    assert steps_on(tmp_path, 0) == [1] and steps_on(tmp_path, 1) == [1]
    assert sorted(p.name for p in folder_of(tmp_path, 1).iterdir()) == [
        DISK, "index.json", "step-00000001"]


def resumed(root: Path) -> list[dict]:
    return [json.loads((root / f"resumed-{r}.json").read_text()) for r in range(SLOTS)]


@pytest.mark.timeout(180)
def test_a_resume_takes_the_newest_on_every_replica_fetching_what_a_disk_lacks(
        tmp_path: Path) -> None:
    """After steps 1-3 (as above), step 3's writer's copy is damaged (a byte flipped) and
    the third disk, which never held step 3, is lost: every replica resumes step 3, the
    writer's disk after moving its damaged copy aside, both disks fetching it from the one
    that holds it good."""
    hosts = [0, 1, 2]
    run(tmp_path, hosts, [(0, 1), (0, 2), (1, 3)])
    copy = next_after(disk_order(tmp_path, hosts), 1)
    third = ({0, 1, 2} - {1, copy}).pop()
    shard = folder_of(tmp_path, 1) / "step-00000003" / "rank-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    shutil.rmtree(folder_of(tmp_path, third))
    run(tmp_path, hosts, [], resume=True)
    for r, said in enumerate(resumed(tmp_path)):
        assert said["step"] == 3 and said["same"], said
        assert said["path"] == str(folder_of(tmp_path, hosts[r]) / "step-00000003")
    assert (folder_of(tmp_path, 1) / "damaged" / "step-00000003").is_dir()
    assert steps_on(tmp_path, third) == [3] and steps_on(tmp_path, 1)[-1] == 3


# ----------------------------------------------------------------- dtrain train, live
LIVE_COPIES = CONFIG.replace("background = false", "copies = 1") + """
[fault_tolerance]
mode = "live"
"""


def _two_hosts(folder: Path, steps: int, *flags: str) -> None:
    """`dtrain train` of LIVE_COPIES as two machines on loopback (node 0 holds the store),
    one live replica each, each machine's out_dir its own (folder/A/run, folder/B/run):
    both end well."""
    train_apart(folder, LIVE_COPIES, steps, *flags)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_dtrain_train_live_replicas_copy_checkpoints_and_resume_from_either_host(
        tmp_path: Path) -> None:
    """Two machines, one live replica each, each with its own disk, checkpoint.copies = 1:
    every checkpoint (saved in the background, and the last one) is on both disks. After
    host A's folder is lost, the job resumed on both trains on from step 4, both disks
    hold the new checkpoints, and the weights are those of one process resumed from step 4
    (SGD on the same global batch)."""
    first = tmp_path / "first"
    first.mkdir()
    _two_hosts(first, 4)
    for host in "AB":
        assert [e["step"] for e in atomic.read_index(first / host / "run" / "checkpoints")] == \
            [2, 4], host
    one = tmp_path / "one"
    shutil.copytree(first / "B" / "run", one / "run")
    (one / "job.toml").write_text(CONFIG)
    result = dtrain("train", str(one / "job.toml"), "-n", "1", "--resume", "--set",
                    "train.steps=6", "--set", f"train.out_dir='{one / 'run'}'")
    assert result.returncode == 0, result.stdout + result.stderr
    lost = tmp_path / "lost"
    shutil.copytree(first, lost)
    shutil.rmtree(lost / "A" / "run")  # host A's disk is gone
    _two_hosts(lost, 6, "--resume")
    assert "(step 4)" in (lost / "A.out").read_text()
    for host in "AB":
        checkpoints = lost / host / "run" / "checkpoints"
        assert [e["step"] for e in atomic.read_index(checkpoints)] == [4, 6], host
        torch.testing.assert_close(model_of(checkpoints), model_of(one / "run" / "checkpoints"),
                                   rtol=1e-5, atol=1e-6)
