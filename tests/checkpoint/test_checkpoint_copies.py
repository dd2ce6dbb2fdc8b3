"""Checkpoints without a shared filesystem (dtrain.checkpoint.copies, `checkpoint.copies`):
three ranks on this machine stand for three hosts, each with a folder of its own. A save
leaves each host its own files and a copy of the previous host's; with one host's folder
deleted, every rank resumes the same checkpoint (each tensor and each rank's own tensors
equal to what was saved), and `dtrain export` works from the folders left.

The whole job with real hosts (network namespaces, `dtrain train` resumed after a host's
folder is lost, bit for bit against an undisturbed resume) is in tests/launch/test_multihost.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dtrain.checkpoint import atomic, background, universal
from dtrain.checkpoint.copies import HostCopies, check_copies
from dtrain.errors import ConfigError, DtrainError
from dtrain.testing import run_ranks

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
