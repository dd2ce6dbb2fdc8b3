"""Faults injected on purpose (dtrain.faults, signals, a full disk): jobs restart and resume
to the weights of an uninterrupted run, a dead, stalled or diverging rank is named within
the timeout and nothing is left running, and no crash loses the latest checkpoint."""

from __future__ import annotations

import errno
import multiprocessing
import os
import random
import re
import resource
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from dtrain import env, faults
from dtrain.checkpoint import atomic, universal
from dtrain.comm.shm import segment
from dtrain.errors import ConfigError, DtrainError
from dtrain.launch import waker
from tests.support import forked, soak
from tests.support.cli import dtrain, one_error_line
from tests.support.poll import until
from tests.train.test_train import model_of, short_run, short_run_result

# ------------------------------------------------------------------- elastic restarts
KILL_RANK_1_AT_STEP_5 = {"DTRAIN_FAULT": "kill@step=5,rank=1"}
# Blocking saves: the checkpoint of step 4 is published before step 5, where rank 1 dies (a
# background save would still be writing it, and the run would resume from step 2).
RESTART = ["--max-restarts", "1", "--set", "checkpoint.every=2",
           "--set", "checkpoint.background=false"]
NO_DECAY = ["--set", "optimizer.weight_decay=0", "--set", "optimizer.grad_clip=0"]
MODES = {
    "dp": ["-n", "2"],
    "zero2": ["-n", "2", "--set", "parallel.zero=2"],
    "tp": ["-n", "2", "--set", "parallel.tp=2"],
    "pp": ["-n", "2", "--set", "parallel.pp=2", "--set", "parallel.microbatches=2"],
    "ps": ["-n", "2", *NO_DECAY, "--set", "parallel.exchange='ps'", "--set",
           "ps.snapshot_every=2"],
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """One process, six steps: with and without weight decay and clipping (ps turns them
    off, see test_train's parameter-server test)."""
    folder = tmp_path_factory.mktemp("reference")
    return {"plain": short_run(folder, "plain", ["-n", "1"]),
            "no_decay": short_run(folder, "no_decay", ["-n", "1", *NO_DECAY])}


@pytest.mark.slow  # 25-30 s each on 2 cores: make test-slow
@pytest.mark.parametrize("mode", ["dp", "zero2", "tp", "pp", "ps"])
def test_a_killed_rank_restarts_and_the_run_ends_as_if_uninterrupted(
        tmp_path: Path, mode: str, uninterrupted: dict[str, tuple]) -> None:
    """Rank 1 SIGKILLs itself as step 5 begins; the agent restarts every rank, `dtrain
    train` resumes from step 4's checkpoint by itself, and the final weights are those of
    one process that never stopped. (dp runs with make test; the others with test-slow.)"""
    losses, checkpoints, stdout = short_run(tmp_path, mode, [*MODES[mode], *RESTART],
                                            env=KILL_RANK_1_AT_STEP_5)
    assert "resumed from" in stdout and "(step 4)" in stdout, stdout
    reference = uninterrupted["no_decay" if mode == "ps" else "plain"]
    torch.testing.assert_close(model_of(checkpoints), model_of(reference[1]),
                               rtol=1e-4, atol=2e-5)
    assert universal.Checkpoint(checkpoints).step == 6


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_dtrain_train_goes_on_when_a_parameter_server_with_a_backup_is_killed(
        tmp_path: Path, uninterrupted: dict[str, tuple]) -> None:
    """`dtrain train` with `parallel.exchange = "ps"` on 2 servers holding 2 copies of each
    shard: server 0 SIGKILLs itself as the pushes of step 3 reach it. Its launcher process
    says the next copies take over, the job ends with exit 0 and no restart, each push was
    applied once to each shard, and the weights are one process's (sync: the same global
    batch, no decay or clipping, which ps turns off)."""
    result = short_run_result(
        tmp_path, "backup", ["-n", "2", *NO_DECAY, "--set", "parallel.exchange='ps'",
                             "--set", "ps.servers=2", "--set", "ps.copies=2"],
        env={env.FAULT.name: "kill@push=3,rank=0"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert ("parameter server 0 was killed by SIGKILL; the next copies of its shards take "
            "over (2 copies of each) and the job goes on") in result.stderr, result.stderr
    assert "resumed from" not in result.stdout
    for shard in (0, 1):
        assert (f"parameter server 1, shard {shard}: pushes applied per worker {{0: 6, 1: 6}}"
                in result.stderr), result.stderr
    torch.testing.assert_close(model_of(tmp_path / "backup" / "checkpoints"),
                               model_of(uninterrupted["no_decay"][1]), rtol=1e-4, atol=2e-5)


@pytest.mark.slow
def test_a_kill_in_the_middle_of_a_save_restarts_from_the_checkpoint_before(
        tmp_path: Path, uninterrupted: dict[str, tuple]) -> None:
    """Rank 1 dies inside the save of step 2 (its file written, the checkpoint not yet
    published): the restart finds no checkpoint and starts over, and ends as one process."""
    losses, checkpoints, stdout = short_run(tmp_path, "save", ["-n", "2", *RESTART],
                                            env={"DTRAIN_FAULT": "kill@save,rank=1"})
    assert "resumed from" not in stdout
    torch.testing.assert_close(model_of(checkpoints), model_of(uninterrupted["plain"][1]),
                               rtol=1e-4, atol=2e-5)
    assert not list(checkpoints.glob(".step-*.tmp"))


def test_fault_descriptions_are_checked() -> None:
    assert faults.parse("kill@step=5,rank=1") == faults.Fault("kill", "step", "5", 1, 0)
    assert faults.parse("stop@save,attempt=1").attempt == 1
    for bad in ("explode@step=1", "kill", "kill@epoch=2", "kill@step=1,rank=x"):
        with pytest.raises(ConfigError, match="DTRAIN_FAULT"):
            faults.parse(bad)


# ---------------------------------------------------------------------------- no hangs
JOB = """
import os, signal, sys, time, torch, dtrain
from dtrain import comm
w = dtrain.init()
open(f"{sys.argv[1]}/pid-{w.rank}", "w").write(str(os.getpid()))
t = torch.ones(1000)
comm.all_reduce(t)
if w.rank == 1 and sys.argv[2] == "stop":
    os.kill(os.getpid(), signal.SIGSTOP)
if w.rank == 1 and sys.argv[2] == "diverge":
    comm.broadcast(torch.zeros(7), 0)
else:
    comm.all_reduce(t)
time.sleep(600)  # the job must be stopped by the failure, not by finishing
"""


@pytest.mark.parametrize("fault, backend, message", [
    pytest.param("stop", "gloo", "timed out after 3s; never arrived: rank 1",
                 marks=pytest.mark.slow),
    pytest.param("stop", "shm", "never arrived: rank 1", marks=pytest.mark.slow),
    pytest.param("diverge", "gloo", "called another collective: rank 1 (in broadcast #",
                 marks=pytest.mark.slow),
], ids=["stop-gloo", "stop-shm", "diverge-gloo"])
def test_a_stalled_or_diverging_rank_is_named_and_nothing_is_left(
        tmp_path: Path, fault: str, backend: str, message: str) -> None:
    """Rank 1 stops (SIGSTOP: alive, silent) or calls another collective than rank 0.
    Rank 0 fails within the timeout naming rank 1 and the collective; `dtrain run` exits
    non-zero within seconds (the launcher continues the stopped rank, so the agent's
    SIGTERM lands); no rank process or shared-memory segment survives. (test-slow: a few
    seconds each, the collectives' timeout 3 s.)"""
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(JOB))
    run_id = f"faults{os.getpid()}{fault}{backend}"
    start = time.monotonic()
    result = dtrain("run", "-n", "2", "--backend", backend, str(job), str(tmp_path), fault,
                    env={"DTRAIN_TIMEOUT": "3", "DTRAIN_RUN_ID": run_id,
                         "DTRAIN_STALL_TIMEOUT": "0"},  # the collective's own diagnosis
                    timeout=90)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert message in result.stdout + result.stderr, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("dtrain: error: rank ")
    assert elapsed < 60, elapsed
    for rank in (0, 1):
        assert not _alive(int((tmp_path / f"pid-{rank}").read_text())), f"rank {rank} lives on"
    assert not list(segment.SHM_DIR.glob(f"{segment.PREFIX}{run_id}-*"))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_stalled_rank_is_failed_within_seconds_not_at_the_collective_timeout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 stops (SIGSTOP) while rank 0 waits in an all-reduce that would time out only
    after 120 s: the launcher finds rank 1 stopped for DTRAIN_STALL_TIMEOUT (5 s unless
    set; 2 s here), kills it, and the job ends well within 10 s of the stop, naming it.
    (test-slow: about 10 s.)"""
    monkeypatch.delenv(env.STALL_TIMEOUT.name, raising=False)
    assert waker.stall_timeout() == 5.0  # the default
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(JOB))
    start = time.monotonic()
    result = dtrain("run", "-n", "2", str(job), str(tmp_path), "stop",
                    env={"DTRAIN_TIMEOUT": "120", env.STALL_TIMEOUT.name: "2"}, timeout=90)
    elapsed = time.monotonic() - start
    error = result.stderr.strip().splitlines()[-1]
    assert result.returncode != 0
    assert error.startswith("dtrain: error: rank 1 was stopped (SIGSTOP) for 2s and killed "
                            "(set DTRAIN_STALL_TIMEOUT to allow longer)"), result.stderr
    assert elapsed < 22, elapsed  # start-up, 2 s stopped, the stop of rank 0
    for rank in (0, 1):
        assert not _alive(int((tmp_path / f"pid-{rank}").read_text())), f"rank {rank} lives on"


def test_ranks_die_with_a_killed_launcher(tmp_path: Path) -> None:
    """`dtrain run` SIGKILLed (it cannot stop anything then): its ranks die with it,
    instead of training on alone."""
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent("""
        import os, sys, time, dtrain
        w = dtrain.init()
        open(f"{sys.argv[1]}/pid-{w.rank}", "w").write(str(os.getpid()))
        time.sleep(600)
    """))
    launcher = subprocess.Popen([sys.executable, "-m", "dtrain.cli", "run", "-n", "2", str(job),
                                 str(tmp_path)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    ranks = _started_ranks(tmp_path, launcher)
    launcher.kill()
    launcher.wait()
    until(lambda: not any(_alive(pid) for pid in ranks), 10,
          "end of every rank after its launcher")


def _started_ranks(folder: Path, launcher: subprocess.Popen | forked.Launched) -> list[int]:
    """The pids the two ranks of `launcher`'s job write to folder/pid-R, once both have."""
    files = [folder / f"pid-{rank}" for rank in (0, 1)]
    until(lambda: all(f.exists() and f.read_text() for f in files), 60,
          "pid file of each rank", running=[launcher.poll])
    return [int(f.read_text()) for f in files]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead too
        return stat.read().rpartition(")")[2].split()[0] != "Z"


# --------------------------------------------------------------------- nothing lost
def _save_for_ever(folder: Path, saving) -> None:
    """Save checkpoints of a 1 MiB tensor whose values are the step, from the newest one on
    (so the first save rewrites it, as a resumed run does), until killed; `saving` is set
    as the first save begins."""
    try:
        step = universal.Checkpoint(folder).step
    except DtrainError:
        step = 1
    saving.set()
    while True:
        values = torch.full((256, 1024), float(step))
        pieces = [*universal.pieces_of("model/w", values, 0, 2),
                  *universal.pieces_of("model/w", values, 1, 2)]
        universal.save(folder, step, pieces, {}, {}, keep_last=2, group=None)
        step += 1


TRIALS = soak.rounds(quick=5, full=50)
"""Kills of the random-moment drills (both this file's and test_background_save's): 5 by
default, 50 under `make soak` (tests/support/soak.py)."""


def sigkill_at_random_moments(save_for_ever, folder: Path, preload: str,
                              longest_pause: float) -> None:
    """TRIALS times: `save_for_ever(folder, saving)` runs in a process (a fork of a clean
    one with `preload` imported: it starts in milliseconds) that is SIGKILLed a random
    0..`longest_pause` s after a moment of one of two kinds, in turn: `saving` set (the
    first save of the process, which rewrites the newest checkpoint, as a resumed run's
    does; before any checkpoint at first), or a newer checkpoint listed (a later save, or
    the moment between two). The pauses of each kind are spread: the k-th of n at a random
    point of the k-th n-th of the span, so that a few kills still reach across it. Every
    time, the newest checkpoint listed in `folder` opens (all checksums verified) and holds
    the values of its step, and the steps never go back; at least one kill in ten (5 of 50)
    lands inside a save: on a machine too busy for TRIALS kills to reach one (the pauses
    are the same, the saves slower), more follow at the first save's moment, up to
    TRIALS more, until enough have."""
    rng = random.Random(0)
    newest, kills_while_writing, inside = 0, 0, max(1, TRIALS // 10)
    spawner = multiprocessing.get_context("forkserver")
    spawner.set_forkserver_preload([preload])
    trial = 0
    while trial < TRIALS or (kills_while_writing < inside and trial < 2 * TRIALS):
        saving = spawner.Event()
        saver = spawner.Process(target=save_for_ever, args=(folder, saving))
        saver.start()
        assert saving.wait(60), "the saver did not start"
        if trial < TRIALS and trial % 2:
            _wait_for_a_newer_checkpoint(folder, newest, saver)
        if trial < TRIALS:
            nth, of = trial // 2, (TRIALS - trial % 2 + 1) // 2  # this kind's nth, of `of`
            time.sleep((nth + rng.random()) / of * longest_pause)
        else:  # one more at the first save's moment, anywhere in the span
            time.sleep(rng.random() * longest_pause)
        trial += 1
        kills_while_writing += any(folder.glob(".step-*.tmp"))
        os.kill(saver.pid, signal.SIGKILL)
        saver.join()
        try:
            ckpt = universal.Checkpoint(folder)
        except DtrainError as exc:
            assert "no checkpoint" in str(exc) and newest == 0, exc
            continue
        assert ckpt.step >= newest
        newest = ckpt.step
        torch.testing.assert_close(ckpt.tensor("model/w"), torch.full((256, 1024), float(newest)))
    assert newest > 0 and kills_while_writing >= inside  # kills inside saves


def _wait_for_a_newer_checkpoint(folder: Path, newest: int, saver) -> None:
    """Until `folder` lists a checkpoint of a step after `newest` (the saver's own)."""
    until(lambda: any(e["step"] > newest for e in atomic.read_index(folder)), 60,
          f"checkpoint after step {newest} from the saver",
          running=[lambda: None if saver.is_alive() else saver.exitcode], every=0.001)


@pytest.mark.slow
def test_sigkill_at_random_moments_of_saving_never_loses_the_newest_checkpoint(
        tmp_path: Path) -> None:
    """TRIALS times (5; 50 under make soak): a process saving checkpoints in a loop is
    SIGKILLed at a random moment. Every time, the newest listed checkpoint opens (all
    checksums verified) and holds the values of its step, and the steps never go back."""
    # a save takes about 6 ms here
    sigkill_at_random_moments(_save_for_ever, tmp_path, "dtrain.checkpoint.universal", 0.05)


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous(tmp_path: Path) -> None:
    """A run saves step 2; resumed with files capped below the checkpoint's size (the
    kernel refuses the write, as on a full disk), it stops at the save of step 4 with one
    line, and step 2 is still the newest checkpoint and loads."""
    _, checkpoints, _ = short_run(tmp_path, "run", ["-n", "1"], steps=2)
    size = (checkpoints / "step-00000002" / "rank-00000.safetensors").stat().st_size

    def cap_files() -> None:  # in the child, before it starts
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, size // 2))

    result = short_run_result(tmp_path, "run", ["-n", "1", "--resume"], steps=4,
                              preexec=cap_files)
    assert result.returncode != 0
    line = one_error_line(result)
    assert "checkpoint of step 4 not saved in" in line and os.strerror(errno.EFBIG) in line
    assert "step-00000002 is kept" in line
    assert universal.Checkpoint(checkpoints).step == 2
    assert sorted(p.name for p in checkpoints.iterdir()) == ["index.json", "step-00000002"]


# -------------------------------------------------------------------------- security
@pytest.mark.slow
def test_a_jobs_sockets_listen_on_loopback_only(tmp_path: Path) -> None:
    """While a 2-rank job runs, every TCP socket its processes listen on (the launcher's
    store, the agent, gloo's) is bound to the loopback address, not to every interface.
    The ranks hold on until the test has looked (a file it writes then)."""
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent("""
        import os, sys, time, dtrain, torch
        w = dtrain.init()
        torch.distributed.barrier()
        open(f"{sys.argv[1]}/pid-{w.rank}", "w").write(str(os.getpid()))
        deadline = time.monotonic() + 60
        while not os.path.exists(f"{sys.argv[1]}/looked") and time.monotonic() < deadline:
            time.sleep(0.05)
        torch.distributed.barrier()
    """))
    proc = forked.start(["run", "-n", "2", str(job), str(tmp_path)],
                        env={**os.environ, "OMP_NUM_THREADS": "1"}, out=tmp_path / "out",
                        err=tmp_path / "err")
    try:
        ranks = _started_ranks(tmp_path, proc)
        time.sleep(0.2)
        bound = _listening({proc.pid, *ranks})  # the launcher is the ranks' parent
    finally:
        (tmp_path / "looked").write_text("")
        proc.wait(timeout=60)
    assert proc.returncode == 0, (tmp_path / "err").read_text()
    assert bound and all(address in LOOPBACK for address, _ in bound), bound


LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")

UNPICKLING = re.compile(r"\bimport (c?pickle|marshal|dill|cloudpickle|shelve)\b|\bpickle\.loads?\b"
                        r"|_object(_list)?\(|\byaml\.load\(")


def test_no_source_can_unpickle_what_it_receives() -> None:
    """A grep over dtrain's sources: nothing imports pickle (or its kin), calls torch's
    object collectives (they unpickle what peers send), or torch.load without
    weights_only=True. The pickle bomb itself is sent in test_bad_input. dtrain.testing
    loads what the ranks it forked itself return to it over a pipe (any value a test
    returns; multiprocessing pickles them anyway), never what comes from a network."""
    package = Path(faults.__file__).parent
    sources = sorted(p for p in package.rglob("*.py")
                     if not p.is_relative_to(package / "testing"))
    assert len(sources) > 50
    for path in sources:
        text = path.read_text()
        assert not UNPICKLING.search(text), f"{path}: {UNPICKLING.search(text)[0]}"
        for call in re.findall(r"torch\.load\([^)]*\)", text):
            assert "weights_only=True" in call, f"{path}: {call}"


def _listening(pids: set[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket the processes `pids` listen on, from /proc."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((socket.inet_ntop(family, raw), int(port, 16)))
    return found
