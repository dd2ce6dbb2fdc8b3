"""Checkpoints saved in the background (dtrain.checkpoint.background): the same checkpoint
as a blocking save of the same moment whatever training changes after the call, errors
raised from `wait()` as the one line a blocking save gives, keep_last, ranks that
coordinate through the store while the training thread runs collectives, and a kill in the
middle of a background write that loses nothing published."""

from __future__ import annotations

import errno
import multiprocessing
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from dtrain.checkpoint import atomic, background, training, universal
from dtrain.errors import DtrainError
from dtrain.testing import run_ranks, run_threads
from tests.faults.test_faults import sigkill_at_random_moments

GPT = {"arch": "gpt", "n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 16}


def held_and_schedulers(parallel: dict | None = None, world_size: int = 1) -> tuple[Any, list]:
    """A tiny GPT held as `parallel` says (default: data parallel), one step trained (so
    the optimizer has state), and its constant schedule."""
    # imported here: the processes the kill tests start import this file, and need none
    from dtrain import layouts, models
    from dtrain.config import config_from_dict, dims_of
    from dtrain.mesh import Mesh
    from dtrain.models.config import ModelConfig

    config = config_from_dict({"model": GPT, "train": {"batch_size": 4, "seed": 5},
                               "parallel": {"nproc": world_size, **(parallel or {})}})
    mesh = Mesh(dims_of(config, world_size))
    torch.manual_seed(0)
    held = layouts.build(models.build(models.resolve(ModelConfig(**GPT), 256)), mesh, config)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda _: 1.0) for o in held.optimizers]
    train_step(held)
    return held, schedulers


def train_step(held: Any, seed: int = 0) -> None:
    x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(seed))
    held.forward_backward([(x, x)])
    held.step()
    held.zero_grad()


def save_args(held: Any, schedulers: list) -> tuple:
    return held.saved, schedulers, {"model": GPT}, 2


def assert_same_checkpoint(a: Path, b: Path) -> None:
    """Two checkpoints with the same tensors, metadata, scalars and per-rank tensors."""
    one, two = universal.Checkpoint(a), universal.Checkpoint(b)
    assert one.step == two.step and one.meta == two.meta and one.extra == two.extra
    assert one.index["world_size"] == two.index["world_size"]
    assert sorted(one.tensors) == sorted(two.tensors) and one.tensors
    for name in one.tensors:
        assert torch.equal(one.tensor(name), two.tensor(name)), name
    for rank in range(one.index["world_size"]):
        first, second = one.rank_tensors(rank), two.rank_tensors(rank)
        assert first.keys() == second.keys()
        assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.fixture
def held() -> tuple[Any, list]:
    return held_and_schedulers()


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Background writers wait for this event before they write a file."""
    gate, write = threading.Event(), universal.write_rank

    def write_when_let(*args: Any) -> None:
        assert gate.wait(30), "the test never let the writer go"
        write(*args)

    monkeypatch.setattr(universal, "write_rank", write_when_let)
    return gate


# ------------------------------------------------------------------- one process
@pytest.mark.timeout(60)
def test_a_background_save_writes_the_state_of_its_call_whatever_changes_after(
        tmp_path: Path, held: tuple, gated: threading.Event) -> None:
    """A background save returns before it writes; the next optimizer step, parameters
    changed in place and the RNG drawn from meanwhile do not reach the checkpoint, which
    is the blocking save's of the same moment, tensor for tensor."""
    gated.set()
    blocking = training.save(tmp_path / "blocking", 1, *save_args(*held))
    gated.clear()
    pending = training.save_in_background(tmp_path / "background", 1, *save_args(*held))
    assert not pending.done()
    train_step(held[0], seed=1)
    with torch.no_grad():
        for p in held[0].module.parameters():
            p.add_(1.0)
    torch.rand(5)
    gated.set()
    path = pending.wait()
    assert pending.done() and path == tmp_path / "background" / blocking.name
    assert_same_checkpoint(blocking, path)
    assert not list((tmp_path / "background").glob(".step-*"))


@pytest.mark.timeout(60)
def test_an_unwritable_folder_fails_wait_with_the_blocking_saves_line(
        tmp_path: Path, held: tuple) -> None:
    """The checkpoints folder cannot be made: `wait()` raises the one line the blocking save
    raises, and a save that nobody waited for raises it at the next save."""
    (tmp_path / "a-file").write_text("")
    bad = tmp_path / "a-file" / "checkpoints"
    with pytest.raises(DtrainError) as blocking:
        training.save(bad, 3, *save_args(*held))
    line = str(blocking.value)
    assert "checkpoint of step 3 not saved in" in line and "\n" not in line
    pending = training.save_in_background(bad, 3, *save_args(*held))
    with pytest.raises(DtrainError) as waited:
        pending.wait()
    assert str(waited.value) == line
    training.save_in_background(bad, 3, *save_args(*held))  # not waited for
    with pytest.raises(DtrainError) as next_save:
        training.save_in_background(tmp_path / "good", 4, *save_args(*held))
    assert str(next_save.value) == line
    assert training.save_in_background(tmp_path / "good", 4, *save_args(*held)).wait().exists()


@pytest.mark.timeout(60)
def test_a_full_disk_during_a_background_write_keeps_the_previous(
        tmp_path: Path, held: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """The write fails (no space left): the hidden folder goes, `wait()` raises the line
    that names the previous checkpoint, which still loads."""
    first = training.save_in_background(tmp_path, 1, *save_args(*held)).wait()

    def full(*_: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(universal, "write_rank", full)
    with pytest.raises(DtrainError, match="checkpoint of step 2 not saved in") as failed:
        training.save_in_background(tmp_path, 2, *save_args(*held)).wait()
    assert os.strerror(errno.ENOSPC) in str(failed.value)
    assert f"the previous checkpoint {first} is kept" in str(failed.value)
    assert universal.Checkpoint(tmp_path).step == 1
    assert not list(tmp_path.glob(".step-*"))


@pytest.mark.timeout(60)
def test_background_saves_keep_the_last_ones_and_one_at_a_time(
        tmp_path: Path, held: tuple) -> None:
    """Five saves in a row, keep_last=2: a save waits for the one before (never two in
    flight), and the newest two are listed and on disk, nothing else."""
    pendings = []
    for step in range(1, 6):
        pendings.append(training.save_in_background(tmp_path, step, *save_args(*held)))
        assert all(p.done() for p in pendings[:-1])
    pendings[-1].wait()
    assert [e["step"] for e in atomic.read_index(tmp_path)] == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "index.json", "step-00000004", "step-00000005"]
    assert universal.Checkpoint(tmp_path / "step-00000004").step == 4


# ----------------------------------------------------------- ranks through the store
def _pieces(rank: int, step: int) -> list[universal.Piece]:
    values = torch.arange(1000, dtype=torch.float32) + step
    return universal.pieces_of("model/w", values, rank, 2)


def _thread_rank(rank: int, folder: str, fail_rank: int | None) -> list[str]:
    folder, said = Path(folder), []
    for step in (1, 2, 3):
        rng = {"seed": torch.tensor([rank, step])}
        pending = background.save(folder / "background", step, _pieces(rank, step),
                                  {"scalars": {f"w{rank}": {"step": step}}}, {"m": step}, 2,
                                  rank_tensors=rng)
        universal.save(folder / "blocking", step, _pieces(rank, step),
                       {"scalars": {f"w{rank}": {"step": step}}}, {"m": step}, 2,
                       rank_tensors=rng)
        said.append(pending.wait().name)
    if fail_rank is not None:
        try:
            background.save(folder / "background", 4, _pieces(rank, 4), {}, {}, 2).wait()
        except DtrainError as exc:
            said.append(str(exc))
    return said


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fail_rank", [None, 0, 1])
def test_ranks_in_threads_save_together_and_fail_together(
        tmp_path: Path, fail_rank: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks (threads) save three steps in the background beside blocking saves of the
    same pieces: the same checkpoints. Then one rank's write fails: both ranks' `wait()`
    raise its line, and the previous checkpoint is still the newest."""
    write = universal.write_rank

    def fails_on(tmp: Path, rank: int, *args: Any) -> None:
        if rank == fail_rank and tmp.name == ".step-00000004.tmp":
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
        write(tmp, rank, *args)

    monkeypatch.setattr(universal, "write_rank", fails_on)
    said = run_threads(_thread_rank, 2, str(tmp_path), fail_rank)
    assert said[0][:3] == said[1][:3] == ["step-00000001", "step-00000002", "step-00000003"]
    for step in (2, 3):
        name = f"step-{step:08d}"
        assert_same_checkpoint(tmp_path / "blocking" / name, tmp_path / "background" / name)
    if fail_rank is not None:
        assert said[0][3] == said[1][3]
        assert os.strerror(errno.EDQUOT) in said[0][3] and "step-00000003 is kept" in said[0][3]
        assert universal.Checkpoint(tmp_path / "background").step == 3
        assert not list((tmp_path / "background").glob(".step-*"))


def _only_rank_0_saves(rank: int, folder: str) -> str:
    if rank == 1:
        return ""
    try:
        background.save(Path(folder), 1, _pieces(rank, 1), {}, {}, 2).wait()
    except DtrainError as exc:
        return str(exc)
    return "saved"


@pytest.mark.timeout(60)
def test_a_rank_that_never_writes_fails_the_save_after_the_timeout(tmp_path: Path) -> None:
    """Rank 1 never saves: rank 0's `wait()` raises, after the group's timeout, the line that
    names the rank, and leaves nothing behind."""
    said, _ = run_threads(_only_rank_0_saves, 2, str(tmp_path), timeout=1.0)
    assert said.startswith("checkpoint of step 1 not saved in")
    assert "rank 1 did not write its pieces within 1 s" in said
    assert not tmp_path.exists() or not list(tmp_path.glob(".step-*"))


def _train_and_save(folder: str) -> dict[str, torch.Tensor]:
    """Data parallel over 2 ranks (gloo): save step 2 in the background, train steps 3-4
    (collectives while it writes), then step 4 both ways. Returns step 2's parameters."""
    held, schedulers = held_and_schedulers(world_size=2)
    folder = Path(folder)
    train_step(held, seed=2)
    at_two = {n: p.detach().clone() for n, p in held.module.named_parameters()}
    pending = training.save_in_background(folder / "background", 2, *save_args(held, schedulers))
    for step in (3, 4):
        train_step(held, seed=step)
    assert pending.wait().name == "step-00000002"
    pending = training.save_in_background(folder / "background", 4, *save_args(held, schedulers))
    training.save(folder / "blocking", 4, *save_args(held, schedulers))  # waits for it first
    assert pending.done()
    return at_two


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_processes_save_in_the_background_while_training_runs_collectives(
        tmp_path: Path) -> None:
    """Two gloo ranks keep training (gradient all-reduces) while their background save
    coordinates through the store: no deadlock, step 2 holds the weights of step 2, and
    step 4 is the blocking save's checkpoint."""
    at_two, _ = run_ranks(_train_and_save, 2, str(tmp_path), timeout=150)
    saved = universal.Checkpoint(tmp_path / "background" / "step-00000002").model_state()
    for name, value in at_two.items():
        assert torch.equal(saved[name.removeprefix("module.")], value), name
    assert_same_checkpoint(tmp_path / "blocking" / "step-00000004",
                           tmp_path / "background" / "step-00000004")


# ----------------------------------------------------------------- nothing lost
def _killed_in_second_save(folder: Path) -> None:
    """Save step 1 in the background and wait; then save step 2 with a fault that SIGKILLs
    the process inside the writer thread (its file written, nothing published), while this
    thread trains on."""
    values = torch.full((256, 1024), 1.0)
    background.save(folder, 1, universal.pieces_of("model/w", values), {}, {}, 2,
                    group=None).wait()
    os.environ["DTRAIN_FAULT"] = "kill@save"
    values.fill_(2.0)
    background.save(folder, 2, universal.pieces_of("model/w", values), {}, {}, 2, group=None)
    while True:
        values.add_(1.0)


@pytest.mark.timeout(60)
def test_a_kill_inside_a_background_write_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """DTRAIN_FAULT=kill@save fires in the writer thread of step 2 (its file written, not
    published) while the process trains on: step 1 is still the newest checkpoint and loads,
    the half-written folder is ignored, and the next save sweeps it."""
    spawner = multiprocessing.get_context("spawn")
    saver = spawner.Process(target=_killed_in_second_save, args=(tmp_path,))
    saver.start()
    saver.join(50)
    assert saver.exitcode == -signal.SIGKILL
    assert (tmp_path / ".step-00000002.tmp" / "rank-00000.safetensors").exists()
    ckpt = universal.Checkpoint(tmp_path)
    assert ckpt.step == 1 and torch.equal(ckpt.tensor("model/w"), torch.full((256, 1024), 1.0))
    background.save(tmp_path, 3, universal.pieces_of("model/w", torch.ones(4)), {}, {}, 2,
                    group=None).wait()
    assert not (tmp_path / ".step-00000002.tmp").exists()


def _save_for_ever_in_background(folder: Path, saving) -> None:
    """Train a 1 MiB tensor whose values are the step, saving every step in the background
    from the newest checkpoint on, and overwrite it as soon as each save returns (the next
    step's update), until killed."""
    try:
        step = universal.Checkpoint(folder).step
    except DtrainError:
        step = 1
    values = torch.empty(256, 1024)
    background.save(folder.parent / "warm-up", 1, universal.pieces_of("model/w", values), {},
                    {}, keep_last=1, group=None).wait()  # first-time imports and allocations
    saving.set()
    while True:
        values.fill_(float(step))
        pieces = [*universal.pieces_of("model/w", values, 0, 2),
                  *universal.pieces_of("model/w", values, 1, 2)]
        background.save(folder, step, pieces, {}, {}, keep_last=2, group=None)
        values.fill_(-1.0)
        step += 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_at_random_moments_of_background_saving_never_loses_the_newest(
        tmp_path: Path) -> None:
    """As tests/faults/test_faults.py's test for blocking saves: TRIALS times (5; 50 under make
    soak), a process saving in the background while it trains is SIGKILLed at a random
    moment. Every time the newest listed checkpoint opens and holds the values of its step,
    and the steps never go back."""
    sigkill_at_random_moments(_save_for_ever_in_background, tmp_path / "checkpoints",
                              "tests.checkpoint.test_background_save", 0.1)  # a save: 10-40 ms here
