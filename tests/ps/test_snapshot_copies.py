"""Parameter servers on hosts without a shared filesystem (`[checkpoint] copies` with
`parallel.exchange = "ps"`): each host's server snapshots travel in its first worker's
checkpoint files (dtrain.ps.host_snapshots) and are copied to the other hosts with them
(dtrain.checkpoint.copies.HostCopies); a host whose disk is lost gets them back at the
resume, and its server, seeded afterwards, resumes from them.

Two ranks stand for two hosts, each with a folder of its own, as in
tests/checkpoint/test_checkpoint_copies.py; the whole job is `dtrain train` on two
launchers on loopback, each machine's out_dir its own (slow).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from dtrain import env, ps
from dtrain.checkpoint import atomic, universal
from dtrain.checkpoint.copies import HostCopies
from dtrain.config import load_config
from dtrain.ps.host_snapshots import HostSnapshots
from dtrain.ps.shard import ShardCopy
from dtrain.ps.wire import Message
from dtrain.testing import run_ranks
from tests.checkpoint.test_fallback import CONFIG
from tests.support.cli import train_apart
from tests.train.test_train import model_of

HOSTS, NUMEL, WORKERS = 2, 10, 2
SETTINGS = ps.Settings("sync", optimizer="sgd", lr=0.1, momentum=0.9)


def snapshots_of(root: str, host: int) -> Path:
    return Path(root) / f"host-{host}" / "ps-snapshots"


def trained(shard: int, folder: Path | None) -> ShardCopy:
    """Shard `shard`'s copy seeded and pushed 3 sync rounds by both workers, snapshotting
    each update into `folder`."""
    copy = ShardCopy(shard, NUMEL, WORKERS, folder, snapshot_every=1 if folder else 0)
    g = torch.Generator().manual_seed(shard)
    copy.seed(Message("init", 0, 0, torch.randn(NUMEL, generator=g), meta=SETTINGS.to_json()))
    for clock in range(3):
        for w in range(WORKERS):
            copy.push(Message("push", w, clock, torch.randn(NUMEL, generator=g)))
    return copy


def _carry(root: str, step: int) -> str:
    """Host r (rank r) saves its servers' snapshots in the checkpoint of `step`, with a
    copy on the other host."""
    import torch.distributed as dist

    rank = dist.get_rank()
    copies = HostCopies.open(copies=1, host=rank)
    carried = HostSnapshots(snapshots_of(root, rank), range(rank, rank + 1))
    return str(copies.save(Path(root) / f"host-{rank}" / "checkpoints", step, [], {}, {}, 2,
                           carried.state()))


def _resume(root: str) -> str:
    """Host r resumes: its folder is filled from the other's, its snapshots written back."""
    import torch.distributed as dist

    rank = dist.get_rank()
    copies = HostCopies.open(copies=1, host=rank)
    path = copies.resume(Path(root) / f"host-{rank}" / "checkpoints")
    assert path is not None
    HostSnapshots(snapshots_of(root, rank), range(rank, rank + 1)).load(
        universal.Checkpoint(path).rank_tensors(rank))
    return path


@pytest.mark.timeout(120)
def test_a_lost_hosts_server_snapshots_come_back_from_the_checkpoint_copies(
        tmp_path: Path) -> None:
    """Server r on host r snapshots its shard (and server 1 a backup copy of shard 0);
    both hosts save a checkpoint with copies = 1; host 1's whole disk is lost; at the
    resume its snapshots are written back, bit for bit, and a server there seeded after
    that resumes each copy with the values, optimizer state and clocks it had."""
    root = str(tmp_path)
    held = {(0, 0): trained(0, snapshots_of(root, 0) / "server-0"),
            (1, 1): trained(1, snapshots_of(root, 1) / "server-1"),
            (1, 0): trained(0, snapshots_of(root, 1) / "server-1-shard-0")}
    files = {p.relative_to(tmp_path): p.read_bytes()
             for p in (tmp_path / "host-1").rglob("*") if p.is_file()}
    run_ranks(_carry, HOSTS, root, 1, timeout=90)

    shutil.rmtree(tmp_path / "host-1")  # host 1's disk is gone
    fresh = ShardCopy(1, NUMEL, WORKERS, snapshots_of(root, 1) / "server-1")
    assert not fresh.initialized  # a server there, started before the resume, holds nothing
    paths = run_ranks(_resume, HOSTS, root, timeout=90)
    assert paths[1] == str(tmp_path / "host-1" / "checkpoints" / "step-00000001")
    for name, data in files.items():
        if name.parts[1] == "ps-snapshots" and name.name.endswith(".pt"):
            newest = atomic.read_index(tmp_path / name.parent)[-1]["file"]
            if name.name == newest:
                assert (tmp_path / name).read_bytes() == data, name

    fresh.seed(Message("init", 0, 0, torch.zeros(NUMEL), meta=SETTINGS.to_json()))
    backup = ShardCopy(0, NUMEL, WORKERS, snapshots_of(root, 1) / "server-1-shard-0")
    for copy, before in ((fresh, held[1, 1]), (backup, held[1, 0])):
        torch.testing.assert_close(copy.param, before.param)
        assert copy.clocks.of == before.clocks.of and copy.updates == before.updates == 3
        torch.testing.assert_close(copy.optimizer.state_dict()["state"][0]["momentum_buffer"],
                                   before.optimizer.state_dict()["state"][0]["momentum_buffer"])


def test_checkpoint_copies_are_taken_with_parameter_servers() -> None:
    config = load_config(None, ["checkpoint.copies=1", "parallel.exchange='ps'"])
    assert config.checkpoint.copies == 1 and config.parallel.exchange == "ps"


APART = CONFIG.replace("background = false", "copies = 1") + """
[parallel]
exchange = "ps"

[ps]
snapshot_every = 1
"""


def _two_machines(folder: Path, steps: int, *flags: str) -> str:
    """`dtrain train` of APART as two machines on loopback (node 0 holds the store), a
    worker and a server each, each machine's out_dir its own (folder/A/run, folder/B/run);
    both end well. Returns their output."""
    return train_apart(folder, APART, steps, *flags, env={env.PS_SECRET.name: "ab" * 32})


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_dtrain_train_with_parameter_servers_resumes_after_a_hosts_disk_is_lost(
        tmp_path: Path) -> None:
    """Two machines, a worker and a server each, each with its own disk, checkpoint.copies
    = 1, the servers snapshotting every update: after 4 steps host B's disk is lost (its
    checkpoints and its server's snapshots). Resumed on both, its server resumes from the
    snapshot its worker carried back, and the run ends with the weights of the same resume
    from the folders kept whole."""
    first = tmp_path / "first"
    first.mkdir()
    _two_machines(first, 4)
    for host in "AB":
        assert [e["step"] for e in atomic.read_index(first / host / "run" / "checkpoints")] \
            == [2, 4], host
    kept, lost = tmp_path / "kept", tmp_path / "lost"
    for root in (kept, lost):
        shutil.copytree(first, root)
    shutil.rmtree(lost / "B" / "run")  # host B's disk is gone
    said = _two_machines(lost, 6, "--resume")
    assert "shard 1 resumed from its snapshot at update 4" in said, said
    assert atomic.read_index(lost / "B" / "run" / "ps-snapshots" / "server-1")
    _two_machines(kept, 6, "--resume")
    torch.testing.assert_close(model_of(lost / "A" / "run" / "checkpoints"),
                               model_of(kept / "A" / "run" / "checkpoints"))
