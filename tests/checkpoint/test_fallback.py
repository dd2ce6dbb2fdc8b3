"""A resume takes the newest checkpoint that verifies (dtrain.checkpoint.fallback): a damaged
newer one (a flipped byte in a shard, a truncated index or metadata file, a missing file)
is moved aside under checkpoints/damaged/, never deleted, with one line naming it, why, and
the checkpoint taken; no checkpoint that verifies fails naming each and moves nothing; a
checkpoint named by its path stays an error; the ranks agree on one. `dtrain train
--resume` then equals a resume from the good checkpoint, losses and weights, also after a
restart. Without a shared filesystem (`checkpoint.copies`) a damaged copy is replaced by a
good one from any host that holds it, a copy that arrives wrong asked again of the next."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dtrain import comm
from dtrain.checkpoint import atomic, fallback, training, transfer, universal
from dtrain.checkpoint.copies import HostCopies
from dtrain.errors import ConfigError, DtrainError
from dtrain.testing import run_ranks
from tests.support import forked
from tests.support.cli import EXACT_OPTIMIZER, TINY_MODEL, assert_same_steps, dtrain
from tests.support.poll import until
from tests.train.test_train import model_of


def values(step: int) -> torch.Tensor:
    return torch.randn(6, 5, generator=torch.Generator().manual_seed(step))


def save(folder: Path, step: int, keep_last: int = 3) -> Path:
    return universal.save(folder, step, universal.pieces_of("model/w", values(step)), {},
                          {"step": step}, keep_last, group=None)


def flip(path: Path) -> None:
    """One byte of `path` flipped, in its middle."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def edit_index(path: Path) -> None:
    """index.json still whole and readable, one value changed (a shape): only its digest
    in the checkpoints folder's index tells."""
    data = json.loads(path.read_text())
    data["tensors"]["model/w"]["shape"] = [5, 6]
    path.write_text(json.dumps(data, indent=1))


# (the damage, the file of step 2 it strikes, the words the line gives for it)
DAMAGES = {
    "flipped-shard": (flip, "rank-00000.safetensors", "checksum mismatch"),
    "truncated-index": (truncate, "index.json", "unreadable"),
    "edited-index": (edit_index, "index.json", "checksum mismatch"),
    "truncated-metadata": (truncate, "rank-00000.json", "checksum mismatch"),
    "missing-file": (Path.unlink, "rank-00000.safetensors", "missing"),
}


# ----------------------------------------------------------------- one checkpoints folder
@pytest.mark.parametrize("damage", DAMAGES)
def test_the_newest_that_verifies_is_taken_and_the_damaged_one_moved_aside(
        tmp_path: Path, damage: str) -> None:
    """Steps 1 and 2 saved, step 2 damaged: the fall-back takes step 1, moves step 2 into
    damaged/ whole (the damage with it), lists step 1 alone, and says so in one line.
    Later saves and keep_last leave damaged/ alone."""
    harm, file, why = DAMAGES[damage]
    save(tmp_path, 1)
    newest = save(tmp_path, 2)
    harm(newest / file)
    kept = sorted(p.name for p in newest.iterdir())
    line = fallback.fall_back(tmp_path)
    assert line == (f"checkpoint step-00000002 is damaged ({file}: {why}): moved to "
                    f"{tmp_path.name}/damaged/step-00000002; resuming from step-00000001")
    assert [e["step"] for e in atomic.read_index(tmp_path)] == [1]
    assert sorted(p.name for p in (tmp_path / "damaged" / "step-00000002").iterdir()) == kept
    assert not newest.exists()
    ckpt = universal.Checkpoint(tmp_path)
    assert ckpt.step == 1 and torch.equal(ckpt.tensor("model/w"), values(1))
    for step in (2, 3, 4, 5):
        save(tmp_path, step, keep_last=2)
    assert [e["step"] for e in atomic.read_index(tmp_path)] == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "damaged", "index.json", "step-00000004", "step-00000005"]
    assert (tmp_path / "damaged" / "step-00000002").is_dir()


def test_every_damaged_newer_one_is_skipped_and_a_good_folder_says_nothing(
        tmp_path: Path) -> None:
    """Steps 2 and 3 damaged: both go, in one line, newest first; a folder whose newest
    verifies is left as it is; an empty one too."""
    assert fallback.fall_back(tmp_path) == ""
    for step in (1, 2, 3):
        save(tmp_path, step)
    assert fallback.fall_back(tmp_path) == ""
    flip(tmp_path / "step-00000003" / "rank-00000.safetensors")
    (tmp_path / "step-00000002" / "index.json").unlink()
    assert fallback.fall_back(tmp_path) == (
        f"checkpoint step-00000003 is damaged (rank-00000.safetensors: checksum mismatch): "
        f"moved to {tmp_path.name}/damaged/step-00000003; checkpoint step-00000002 is "
        f"damaged (index.json: missing): moved to {tmp_path.name}/damaged/step-00000002; "
        "resuming from step-00000001")
    assert [e["step"] for e in atomic.read_index(tmp_path)] == [1]


def test_no_checkpoint_that_verifies_fails_naming_each_and_moves_nothing(tmp_path: Path) -> None:
    """Both checkpoints damaged: one line names each and why; nothing is moved, so a
    resume by itself does not start afresh over them next time."""
    save(tmp_path, 1)
    save(tmp_path, 2)
    flip(tmp_path / "step-00000002" / "rank-00000.safetensors")
    truncate(tmp_path / "step-00000001" / "index.json")
    before = json.loads((tmp_path / "index.json").read_text())
    with pytest.raises(DtrainError) as failed:
        fallback.fall_back(tmp_path)
    line = str(failed.value)
    assert line.startswith(f"no checkpoint in {tmp_path} verifies (step-00000002: "
                           "rank-00000.safetensors is corrupted (checksum mismatch); "
                           "step-00000001: index.json is unreadable ("), line
    assert "nothing was moved" in line and "\n" not in line
    assert json.loads((tmp_path / "index.json").read_text()) == before
    assert not (tmp_path / "damaged").exists()
    with pytest.raises(ConfigError, match="checkpoint.resume: no checkpoint in .* verifies"):
        training.open_checkpoint(str(tmp_path), {})


def test_a_damaged_checkpoint_named_by_its_path_stays_an_error(tmp_path: Path) -> None:
    """The user asked for that one: it is refused (nothing moved); its folder, asked for
    instead, gives the one before."""
    save(tmp_path, 1)
    newest = save(tmp_path, 2)
    flip(newest / "rank-00000.safetensors")
    with pytest.raises(ConfigError, match="rank-00000.safetensors is corrupted .*the previous "
                                          "checkpoint is .*step-00000001"):
        training.open_checkpoint(str(newest), {})
    assert training.fall_back(str(newest), torch.device("cpu")) == str(newest)
    assert newest.exists() and not (tmp_path / "damaged").exists()
    assert training.open_checkpoint(str(tmp_path), {}).step == 1  # read only: nothing moved
    assert newest.exists()


def test_a_crash_between_the_move_and_the_index_is_mended_by_the_next_resume(
        tmp_path: Path) -> None:
    """The folder was moved aside, the index not yet written: the next resume finds the
    listed folder gone and unlists it; moving a folder already moved (a second mover)
    does nothing."""
    save(tmp_path, 1)
    newest = save(tmp_path, 2)
    assert fallback.aside(newest, tmp_path, newest.name) == tmp_path / "damaged" / newest.name
    assert fallback.aside(newest, tmp_path, newest.name) is None
    assert fallback.fall_back(tmp_path) == ("checkpoint step-00000002 is damaged (its folder: "
                                            "missing): unlisted (its folder is gone); "
                                            "resuming from step-00000001")
    assert [e["step"] for e in atomic.read_index(tmp_path)] == [1]
    save(tmp_path, 2)  # damaged/ keeps the old one: the new one gets a name of its own
    flip(tmp_path / "step-00000002" / "rank-00000.safetensors")
    assert "moved to " + f"{tmp_path.name}/damaged/step-00000002.1" in fallback.fall_back(tmp_path)


def _fall_back_on_each_rank(folder: str) -> tuple[str, int, str]:
    """Every rank resumes from `folder`: the path it gets, the newest step listed, and
    what it printed."""
    with contextlib.redirect_stderr(io.StringIO()) as said:
        path = training.fall_back(folder, torch.device("cpu"))
    assert path is not None
    return path, universal.Checkpoint(path).step, said.getvalue()


def _refused_on_each_rank(folder: str) -> str:
    try:
        training.fall_back(folder, torch.device("cpu"))
    except ConfigError as exc:
        return str(exc)
    return "resumed"


@pytest.mark.timeout(60)
def test_ranks_agree_on_the_checkpoint_one_of_them_moves_the_damaged_one(
        tmp_path: Path) -> None:
    """Two ranks resume from one folder whose newest is damaged: one moves it and says so,
    both take step 1; with none that verifies, both fail with the same line."""
    save(tmp_path, 1)
    flip(save(tmp_path, 2) / "rank-00000.safetensors")
    resumed = run_ranks(_fall_back_on_each_rank, 2, str(tmp_path))
    assert [r[:2] for r in resumed] == [(str(tmp_path), 1)] * 2
    assert [r[2] for r in resumed] == [
        "dtrain: checkpoint step-00000002 is damaged (rank-00000.safetensors: checksum "
        f"mismatch): moved to {tmp_path.name}/damaged/step-00000002; resuming from "
        "step-00000001\n", ""]
    flip(tmp_path / "step-00000001" / "rank-00000.safetensors")
    refused = run_ranks(_refused_on_each_rank, 2, str(tmp_path))
    assert refused[0] == refused[1]
    assert "no checkpoint in" in refused[0] and "verifies" in refused[0]


# -------------------------------------------------------------------- dtrain train --resume
CONFIG = TINY_MODEL + EXACT_OPTIMIZER + """
[data]
max_bytes = 200000

[train]
batch_size = 8
eval_every = 0
eval_batches = 1

[checkpoint]
every = 2
background = false

[logging]
sample_tokens = 0
"""


def train(folder: Path, steps: int, *args: str) -> tuple[list[dict], str]:
    """`dtrain train` of CONFIG in folder/run for `steps` steps: its metrics rows and
    stderr."""
    config = folder / "config.toml"
    config.write_text(CONFIG)
    metrics = folder / f"metrics-{len(list(folder.glob('metrics-*')))}.jsonl"
    result = dtrain("train", str(config), *args, "--set", f"train.steps={steps}",
                    "--set", f"train.out_dir='{folder / 'run'}'", "--metrics", str(metrics),
                    timeout=170)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r for r in rows if "loss" in r], result.stderr


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 4 steps, checkpoints of steps 2 and 4."""
    folder = tmp_path_factory.mktemp("four")
    train(folder, 4, "-n", "1")
    return folder


@pytest.fixture(scope="module")
def resumed_from_two(four_steps: Path, tmp_path_factory: pytest.TempPathFactory
                     ) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The undisturbed run resumed from step 2's checkpoint (by its path) to step 6: its
    rows and final weights."""
    folder = tmp_path_factory.mktemp("reference")
    shutil.copytree(four_steps / "run", folder / "run")
    rows, _ = train(folder, 6, "-n", "1", "--resume",
                    str(folder / "run" / "checkpoints" / "step-00000002"))
    return rows, model_of(folder / "run" / "checkpoints")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage, nproc", [
    ("flipped-shard", 2), ("truncated-index", 1), ("truncated-metadata", 1),
    ("missing-file", 1)])
def test_dtrain_train_resume_falls_back_and_equals_a_resume_from_the_good_one(
        tmp_path: Path, four_steps: Path, resumed_from_two: tuple, damage: str,
        nproc: int) -> None:
    """Step 4's checkpoint damaged: `dtrain train --resume` says in one line that it is,
    and that it resumes from step 2, moves it under damaged/, and trains steps 3-6 with the
    losses and final weights of the run resumed from step 2 by its path (SGD)."""
    harm, file, why = DAMAGES[damage]
    shutil.copytree(four_steps / "run", tmp_path / "run")
    checkpoints = tmp_path / "run" / "checkpoints"
    harm(checkpoints / "step-00000004" / file)
    rows, stderr = train(tmp_path, 6, "-n", str(nproc), "--resume")
    said = [line for line in stderr.splitlines() if "is damaged" in line]
    assert said == [f"dtrain: checkpoint step-00000004 is damaged ({file}: {why}): moved to "
                    "checkpoints/damaged/step-00000004; resuming from step-00000002"], stderr
    assert [r["step"] for r in rows] == [3, 4, 5, 6]
    want_rows, want_model = resumed_from_two
    assert_same_steps(rows, want_rows)
    torch.testing.assert_close(model_of(checkpoints), want_model, rtol=1e-5, atol=1e-6)
    assert (checkpoints / "damaged" / "step-00000004").is_dir()
    assert [e["step"] for e in atomic.read_index(checkpoints)] == [4, 6]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_restart_after_a_damaged_save_resumes_from_the_good_one(
        tmp_path: Path, resumed_from_two: tuple) -> None:
    """`dtrain train -n 2 --max-restarts 1`: rank 1 freezes as step 5 begins (SIGSTOP), the
    checkpoint of step 4 just published; the test flips a byte of it, and the launcher
    kills the frozen rank (DTRAIN_STALL_TIMEOUT) and restarts the job, which resumes from
    step 2 by itself, saying so, and ends with the weights of the run resumed from step 2."""
    config = tmp_path / "config.toml"
    config.write_text(CONFIG)
    checkpoints = tmp_path / "run" / "checkpoints"
    out = tmp_path / "job.out"
    job = forked.start(["train", str(config), "-n", "2", "--max-restarts", "1",
                        "--set", "train.steps=6", "--set", f"train.out_dir='{tmp_path / 'run'}'"],
                       env={**os.environ, "OMP_NUM_THREADS": "1", "DTRAIN_STALL_TIMEOUT": "3",
                            "DTRAIN_FAULT": "stop@step=5,rank=1"}, out=out)
    try:
        until(lambda: any(e["step"] == 4 for e in atomic.read_index(checkpoints)), 120,
              "the checkpoint of step 4", running=[job.poll], every=0.005,
              describe=out.read_text)
        flip(checkpoints / "step-00000004" / "rank-00001.safetensors")
        assert job.wait(timeout=150) == 0, out.read_text()
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    output = out.read_text()
    assert ("checkpoint step-00000004 is damaged (rank-00001.safetensors: checksum mismatch): "
            "moved to checkpoints/damaged/step-00000004; resuming from step-00000002") in output
    assert f"resumed from {checkpoints / 'step-00000002'} (step 2)" in output, output
    torch.testing.assert_close(model_of(checkpoints), resumed_from_two[1], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------ hosts without a shared folder
HOSTS = 3


def folder_of(root: str, host: int) -> Path:
    return Path(root) / f"host-{host}" / "checkpoints"


def _save_with_copies(root: str, copies: int) -> None:
    """Rank r (host r) saves its share of steps 1 and 2 with `copies` copies."""
    import torch.distributed as dist

    rank = dist.get_rank()
    hosts = HostCopies.open(copies=copies, host=rank)
    for step in (1, 2):
        pieces = universal.pieces_of("model/w", values(step), rank, HOSTS)
        hosts.save(folder_of(root, rank), step, pieces, {}, {"step": step}, 2,
                   {"id": torch.tensor([rank, step])})


def _resume_with_copies(root: str, copies: int, sends_wrong: int | None
                        ) -> tuple[str, torch.Tensor, str] | str:
    """Every rank resumes from its host's folder (the host `sends_wrong` sends its copies
    with a byte flipped): the checkpoint it got, its tensor and what the rank printed; or
    the error."""
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == sends_wrong:
        send = transfer.send_file

        def send_flipped(path: Path, dst: int, group: comm.Group) -> int:
            wrong = path.with_name(f".wrong-{path.name}")
            shutil.copyfile(path, wrong)
            flip(wrong)
            try:
                return send(wrong, dst, group)
            finally:
                wrong.unlink()

        transfer.send_file = send_flipped
    hosts = HostCopies.open(copies=copies, host=rank)
    try:
        with contextlib.redirect_stderr(io.StringIO()) as said:
            path = hosts.resume(folder_of(root, rank))
    except DtrainError as exc:
        return str(exc)
    assert path is not None
    return path, universal.Checkpoint(path).tensor("model/w"), said.getvalue()


def _damage(root: Path, host: int, step: int, file: str,
            harm: Callable[[Path], None] = flip) -> None:
    harm(folder_of(str(root), host) / f"step-{step:08d}" / file)


@pytest.mark.timeout(120)
def test_a_hosts_damaged_copy_is_replaced_by_the_good_one(tmp_path: Path) -> None:
    """copies = 1 on 3 hosts: host 1's own copy of rank 1's data is damaged, and host 0's
    index of step 2: each is replaced by the good copy of another host (host 2, host 1),
    the damaged file kept under damaged/; every rank resumes step 2 from its own folder."""
    run_ranks(_save_with_copies, HOSTS, str(tmp_path), 1)
    _damage(tmp_path, 1, 2, "rank-00001.safetensors")
    _damage(tmp_path, 0, 2, "index.json", truncate)
    resumed = run_ranks(_resume_with_copies, HOSTS, str(tmp_path), 1, None, timeout=90)
    for host, (path, tensor, _) in enumerate(resumed):
        assert path == str(folder_of(str(tmp_path), host) / "step-00000002")
        assert torch.equal(tensor, values(2))
    kept = folder_of(str(tmp_path), 1) / "damaged" / "step-00000002" / "rank-00001.safetensors"
    assert kept.exists()
    assert (folder_of(str(tmp_path), 0) / "damaged" / "step-00000002" / "index.json").exists()
    assert [said for *_, said in resumed] == [
        "dtrain: checkpoint step-00000002: host 0's index.json; host 1's "
        "rank-00001.safetensors did not verify: moved to checkpoints/damaged/step-00000002/ "
        "there, good copies fetched from the hosts that hold them\n", "", ""]


@pytest.mark.timeout(120)
def test_a_copy_that_arrives_wrong_is_asked_of_the_next_holder(tmp_path: Path) -> None:
    """copies = 2 on 3 hosts (every file on every host): host 0 lost rank 1's data; host 1,
    the first holder asked, sends it with a byte flipped (as a failing disk or link would):
    host 0 refuses it and gets it from host 2. With host 2's copy damaged too, no holder
    can send it: every rank fails with the same line, naming what each holder answered."""
    run_ranks(_save_with_copies, HOSTS, str(tmp_path), 2)
    _damage(tmp_path, 0, 2, "rank-00001.safetensors", Path.unlink)
    resumed = run_ranks(_resume_with_copies, HOSTS, str(tmp_path), 2, 1, timeout=90)
    for host, (path, tensor, _) in enumerate(resumed):
        assert path == str(folder_of(str(tmp_path), host) / "step-00000002")
        assert torch.equal(tensor, values(2))
    _damage(tmp_path, 0, 2, "rank-00001.safetensors", Path.unlink)
    _damage(tmp_path, 2, 2, "rank-00001.safetensors")
    failed = run_ranks(_resume_with_copies, HOSTS, str(tmp_path), 2, 1, timeout=90)
    assert failed[0] == failed[1] == failed[2], failed
    assert failed[0].startswith("checkpoint step-00000002: no host could send host 0 a good "
                                "copy of rank-00001.safetensors (host 1: the copy of "
                                "rank-00001.safetensors from rank 1 does not match its "
                                "checksum)"), failed[0]


@pytest.mark.timeout(120)
def test_a_checkpoint_no_host_holds_whole_is_moved_aside_on_each(tmp_path: Path) -> None:
    """copies = 1: both copies of rank 1's data of step 2 damaged (hosts 1 and 2): every
    rank resumes step 1, each host's step 2 is moved aside, and rank 0 says so once."""
    run_ranks(_save_with_copies, HOSTS, str(tmp_path), 1)
    _damage(tmp_path, 1, 2, "rank-00001.safetensors")
    _damage(tmp_path, 2, 2, "rank-00001.safetensors")
    resumed = run_ranks(_resume_with_copies, HOSTS, str(tmp_path), 1, None, timeout=90)
    for host, (path, tensor, _) in enumerate(resumed):
        folder = folder_of(str(tmp_path), host)
        assert path == str(folder / "step-00000001")
        assert torch.equal(tensor, values(1))
        assert (folder / "damaged" / "step-00000002").is_dir()
        assert [e["step"] for e in atomic.read_index(folder)] == [1]
    assert [said for *_, said in resumed] == [
        "dtrain: checkpoint step-00000002 is damaged (rank-00001.safetensors: checksum "
        "mismatch): moved to checkpoints/damaged/step-00000002 on each host that held it; "
        "resuming from step-00000001\n", "", ""]
