"""Checkpoints without a shared filesystem (dtrain.checkpoint.copies, `checkpoint.copies`):
three ranks on this machine stand for three hosts, each with a folder of its own. A save
leaves each host its own files and a copy of the previous host's; with one host's folder
deleted, every rank resumes the same checkpoint (each tensor and each rank's own tensors
equal to what was saved), and `dtrain export` works from the folders left.

The whole job with real hosts (network namespaces, `dtrain train` resumed after a host's
folder is lost, bit for bit against an undisturbed resume) is in tests/launch/test_multihost.py.
Damaged copies replaced from another host are in tests/checkpoint/test_fallback.py. The
drill at the end kills the three hosts' ranks at random moments of their replicated saves,
and resumes: the newest checkpoint the hosts hold whole is never lost.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from dtrain import env
from dtrain.checkpoint import atomic, background, universal
from dtrain.checkpoint.copies import HostCopies, check_copies
from dtrain.errors import ConfigError, DtrainError
from dtrain.testing import fork_server, run_ranks
from tests.faults.test_faults import TRIALS
from tests.support.poll import until

HOSTS = 3


def values(step: int) -> torch.Tensor:
    return torch.randn(7, 5, generator=torch.Generator().manual_seed(step))


def folder_of(root: str, host: int) -> Path:
    return Path(root) / f"host-{host}" / "checkpoints"


def _save(root: str) -> list[str]:
    """Rank r (host r): its share of steps 1 (blocking) and 2 (in the background)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    copies = HostCopies.open(copies=1, host=rank)
    folder = folder_of(root, rank)
    paths = []
    for step, write in ((1, copies.save), (2, None)):
        pieces = universal.pieces_of("model/w", values(step), rank, HOSTS)
        mine = {"id": torch.tensor([rank, step])}
        if write is None:
            paths.append(background.save(folder, step, pieces, {}, {"step": step}, 2,
                                         rank_tensors=mine, copies=copies).wait())
        else:
            paths.append(write(folder, step, pieces, {}, {"step": step}, 2, mine))
    return [str(p) for p in paths]


def _resume(root: str) -> tuple[str, torch.Tensor, dict[str, torch.Tensor]]:
    """Every rank resumes from its own host's folder; the checkpoint's tensor and this
    rank's own tensors."""
    import torch.distributed as dist

    rank = dist.get_rank()
    copies = HostCopies.open(copies=1, host=rank)
    path = copies.resume(folder_of(root, rank))
    ckpt = universal.Checkpoint(path)
    return path, ckpt.tensor("model/w"), ckpt.rank_tensors(rank)


@pytest.mark.timeout(120)
def test_a_lost_hosts_folder_is_refilled_from_the_copies(tmp_path: Path) -> None:
    saved = run_ranks(_save, HOSTS, str(tmp_path), timeout=90)
    for host in range(HOSTS):
        folder = folder_of(str(tmp_path), host)
        assert saved[host] == [str(folder / "step-00000001"), str(folder / "step-00000002")]
        assert [e["step"] for e in atomic.read_index(folder)] == [1, 2]
        own, previous = host, (host - 1) % HOSTS  # its own files and the previous host's
        held = sorted(p.name for p in (folder / "step-00000002").iterdir())
        assert held == sorted(["index.json", *(f"rank-{r:05d}.{s}" for r in (own, previous)
                                               for s in ("json", "safetensors"))])
        copy = folder / "step-00000002" / f"rank-{previous:05d}.safetensors"
        first = folder_of(str(tmp_path), previous) / "step-00000002" / copy.name
        assert copy.read_bytes() == first.read_bytes()

    shutil.rmtree(tmp_path / "host-1")  # host 1's disk is gone
    # export reads the folders left: one alone lacks host 1's files and says where they are
    with pytest.raises(DtrainError, match="checkpoint.copies = 1: other hosts' folders"):
        universal.export(folder_of(str(tmp_path), 0), tmp_path / "one.safetensors")
    out = universal.export(folder_of(str(tmp_path), 0), tmp_path / "model.safetensors",
                           also=[folder_of(str(tmp_path), 2)])
    assert torch.equal(load_file(out)["w"], values(2))

    resumed = run_ranks(_resume, HOSTS, str(tmp_path), timeout=90)
    for rank, (path, tensor, own) in enumerate(resumed):
        assert path == str(folder_of(str(tmp_path), rank) / "step-00000002")
        assert torch.equal(tensor, values(2))
        assert torch.equal(own["id"], torch.tensor([rank, 2]))
    assert [e["step"] for e in atomic.read_index(folder_of(str(tmp_path), 1))] == [2]


def test_replicate_beyond_the_other_hosts_is_refused() -> None:
    check_copies(2, 3)
    with pytest.raises(ConfigError, match=r"checkpoint.copies = 2 copies each host's "
                       r"checkpoint files to 2 other host\(s\), and this job has 2 host\(s\): "
                       r"set it to at most 1"):
        check_copies(2, 2)


# ----------------------------------------------------------------- nothing lost
SHAPE = (256, 1024)  # 1 MiB of float32: each rank's third, and its copy, a few ms to write


def _save_for_ever_with_copies(rank: int, port: int, root: str) -> None:
    """Rank `rank` of a job of HOSTS ranks, one per host, with checkpoint.copies = 1:
    resume (collective: the newest checkpoint the hosts hold whole, refilled where a host
    lacks it), write the step resumed into root/resumed, then save a tensor whose values
    are the step, every step, blocking and in the background in turn, until killed."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(HOSTS), "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1",
                       **env.TIMEOUT.pair(20), **env.BACKEND.pair("gloo")})
    import dtrain

    dtrain.init()
    copies = HostCopies.open(copies=1, host=rank)
    folder = folder_of(root, rank)
    path = copies.resume(folder)
    step = universal.Checkpoint(path).step if path is not None else 0
    if rank == 0:
        atomic.write_atomic(Path(root) / "resumed", lambda f: f.write(str(step).encode()))
    values = torch.empty(SHAPE)
    while True:
        step += 1
        values.fill_(float(step))
        pieces = universal.pieces_of("model/w", values, rank, HOSTS)
        if step % 2:
            background.save(folder, step, pieces, {}, {}, 2, copies=copies).wait()
        else:
            copies.save(folder, step, pieces, {}, {}, 2)


def _newest_whole(root: Path) -> int:
    """The newest step the hosts' folders list and hold whole between them, checked (every
    file's digest, the values of its step); 0 when none."""
    folders = [folder_of(str(root), h) for h in range(HOSTS)]
    steps = sorted({e["step"] for f in folders for e in atomic.read_index(f)}, reverse=True)
    for step in steps:
        first = next(f for f in folders if universal.of_step(f, step) is not None)
        try:
            ckpt = universal.Checkpoint(universal.of_step(first, step) or first,
                                        also=[f for f in folders if f != first])
        except DtrainError as exc:  # a save cut short between two hosts' listings
            assert "is missing" in str(exc), exc
            continue
        torch.testing.assert_close(ckpt.tensor("model/w"), torch.full(SHAPE, float(step)))
        return step
    return 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_at_random_moments_of_replicated_saving_never_loses_the_newest(
        tmp_path: Path) -> None:
    """As the drills of blocking and background saves (tests/faults/test_faults.py,
    test_background_save.py): TRIALS times (5; 50 under make soak), a job of three hosts
    saving with checkpoint.copies = 1 in a loop (blocking and background saves in turn) is
    SIGKILLed at a random moment (one rank first, then the others, as a job torn down
    after a crash): every time, the newest checkpoint the hosts list and hold whole opens
    with every file verified and the values of its step, the steps never go back, and the
    next job resumes exactly that one. At least one kill in ten lands inside a save."""
    rng = random.Random(0)
    newest, inside = 0, 0
    for trial in range(TRIALS):
        store = dist.TCPStore("127.0.0.1", 0, HOSTS, is_master=True,
                              timeout=timedelta(seconds=60), wait_for_workers=False)
        resumed = tmp_path / "resumed"
        resumed.unlink(missing_ok=True)
        ranks = [fork_server().Process(target=_save_for_ever_with_copies,
                                       args=(rank, store.port, str(tmp_path)))
                 for rank in range(HOSTS)]
        for proc in ranks:
            proc.start()
        until(resumed.exists, 60, "the job's resume",
              running=[lambda p=p: p.exitcode for p in ranks])
        assert int(resumed.read_text()) == newest, (trial, newest)
        time.sleep(rng.uniform(0.05, 0.6))
        inside += any(folder_of(str(tmp_path), h).glob(".step-*.tmp") for h in range(HOSTS))
        first = rng.randrange(HOSTS)
        for proc in [ranks[first], *ranks[:first], *ranks[first + 1:]]:
            os.kill(proc.pid, signal.SIGKILL)
        for proc in ranks:
            proc.join()
        del store
        step = _newest_whole(tmp_path)
        assert step >= newest and step > 0, (trial, step, newest)
        newest = step
    assert inside >= max(1, TRIALS // 10), inside
