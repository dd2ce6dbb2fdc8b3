"""dtrain under the real launchers: Open MPI's mpirun, and SLURM's srun and sbatch.

Each test starts 2 ranks on this machine with the launcher itself, the ranks reading only
its environment (no MASTER_ADDR, no MASTER_PORT): they agree a free port through a file
(dtrain.agreed_port), all-reduce, or train the tiny model. The SLURM tests run a one-node
cluster of their own (scripts/slurm-local.sh: munged, slurmctld, slurmd) for the module.

Needs `make install-launchers` (Open MPI, SLURM, munge); the SLURM tests also need root.
Skipped with the reason otherwise. Slow (5-15 s a test on 2 cores): `make test-slow`.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dtrain.agreed_port import folder as port_folder
from tests.support.cli import TINY_MODEL, free_port
from tests.support.paths import ROOT
from tests.support.tools import missing

BIN = Path(sys.executable).parent  # the virtual environment's bin: python and dtrain
SBATCH_EXAMPLE = ROOT / "examples" / "train.sbatch"

TINY = TINY_MODEL + """
[data]
max_bytes = 200000

[train]
steps = 3
batch_size = 16
eval_every = 0

[logging]
log_every = 1
sample_tokens = 0
"""

# Each rank writes its line to a file of its own: a launcher forwarding both ranks' output
# may join their lines (Open MPI did).
ALL_REDUCE = """
from pathlib import Path
import torch
import torch.distributed as dist
import dtrain

world = dtrain.init()
total = torch.tensor([float(world.rank + 1)])
dist.all_reduce(total)
line = f"{world.describe()}: sum {total.item():g} port {world.master_port}"
Path(f"sum-{world.rank}.txt").write_text(line)
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "SLURM_"))}
    env.update(OMP_NUM_THREADS="1", PATH=f"{BIN}:{env.get('PATH', '')}", **extra)
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def _run(command: list[str], cwd: Path, env: dict[str, str], timeout: float
         ) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, (
        f"{shlex.join(command)} exited with {result.returncode}:\n{result.stdout}{result.stderr}")
    return result


def _config(folder: Path) -> list[str]:
    """`dtrain train` arguments for 3 steps of the tiny model into `folder`/run."""
    (folder / "tiny.toml").write_text(TINY)
    return ["tiny.toml", "--set", f"train.out_dir='{folder / 'run'}'"]


def _assert_trained(folder: Path, output: str) -> None:
    assert "2 rank(s), data parallel over 2" in output, output
    assert (folder / "run" / "checkpoints" / "step-00000003" / "index.json").exists(), output


def _assert_summed(folder: Path, output: str, launcher: str) -> list[str]:
    """Both ranks wrote the sum 1 + 2 and the same agreed port; their lines."""
    lines = [(folder / f"sum-{rank}.txt").read_text() for rank in range(2)
             if (folder / f"sum-{rank}.txt").exists()]
    assert len(lines) == 2, output
    for rank, line in enumerate(lines):
        assert re.fullmatch(rf"rank {rank} of 2 from {launcher} \(.*node 0\): sum 3 port \d+",
                            line), output
    assert lines[0].split()[-1] == lines[1].split()[-1] != "0", output
    return lines


@pytest.mark.timeout(10)
def test_sbatch_example_is_on_the_launching_page() -> None:
    page = (ROOT / "docs" / "launching.md").read_text()
    assert f"```bash\n{SBATCH_EXAMPLE.read_text()}```" in page, (
        "docs/launching.md shows examples/train.sbatch verbatim in a ```bash block")


# --- Open MPI ---

@pytest.fixture(scope="module")
def mpirun() -> list[str]:
    """The mpirun command, or a skip saying why there is none."""
    path = shutil.which("mpirun")
    if path is None:
        missing("mpirun not found: `make install-launchers` installs Open MPI")
    version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    if "Open MPI" not in version:
        missing(f"mpirun is not Open MPI's ({version.splitlines()[:1]})")
    return [path, "--oversubscribe", "-n", "2"]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_mpirun_ranks_agree_a_port_and_all_reduce(mpirun: list[str], tmp_path: Path) -> None:
    (tmp_path / "all_reduce.py").write_text(ALL_REDUCE)
    result = _run([*mpirun, str(BIN / "python"), "all_reduce.py"], tmp_path, _env(), 60)
    _assert_summed(tmp_path, result.stdout + result.stderr, "Open MPI")
    assert not list(port_folder().glob("port-openmpi-*")), "rank 0 left its port file"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_mpirun_dtrain_train(mpirun: list[str], tmp_path: Path) -> None:
    args = _config(tmp_path)
    result = _run([*mpirun, str(BIN / "dtrain"), "train", *args], tmp_path, _env(), 120)
    _assert_trained(tmp_path, result.stdout)


# --- SLURM ---

@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A one-node SLURM cluster for the module; yields the environment that reaches it."""
    missing = [t for t in ("slurmctld", "slurmd", "srun", "sbatch", "munged", "mungekey")
               if shutil.which(t) is None]
    if missing:
        missing(f"{', '.join(missing)} not found: `make install-launchers` installs SLURM")
    if os.geteuid() != 0:
        missing("starting slurmctld and slurmd needs root")
    folder = tmp_path_factory.mktemp("slurm")
    env = _env(DTRAIN_SLURM_DIR=str(folder / "cluster"),
               DTRAIN_SLURMCTLD_PORT=str(free_port()), DTRAIN_SLURMD_PORT=str(free_port()))
    script = [str(ROOT / "scripts" / "slurm-local.sh")]
    try:
        _run([*script, "start"], ROOT, env, 60)
        yield {**env, "SLURM_CONF": str(folder / "cluster" / "slurm.conf")}
    finally:
        subprocess.run([*script, "stop"], env=env, capture_output=True, timeout=60)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_srun_ranks_agree_a_port_and_all_reduce(slurm: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "all_reduce.py").write_text(ALL_REDUCE)
    result = _run(["srun", "-n", "2", str(BIN / "python"), "all_reduce.py"], tmp_path, slurm,
                  60)
    lines = _assert_summed(tmp_path, result.stdout + result.stderr, "SLURM")
    assert all("(job " in line for line in lines), lines


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_srun_dtrain_train(slurm: dict[str, str], tmp_path: Path) -> None:
    args = _config(tmp_path)
    result = _run(["srun", "-n", "2", "dtrain", "train", *args], tmp_path, slurm, 120)
    _assert_trained(tmp_path, result.stdout)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_sbatch_example_trains(slurm: dict[str, str], tmp_path: Path) -> None:
    args = _config(tmp_path)
    out = tmp_path / "job.out"
    submitted = _run(["sbatch", "--parsable", f"--output={out}", str(SBATCH_EXAMPLE), *args],
                     tmp_path, slurm, 30)
    job = submitted.stdout.strip().split(";")[0]
    state, code = _wait_for_job(job, slurm, timeout=120)
    output = out.read_text() if out.exists() else "(no output file)"
    assert (state, code) == ("COMPLETED", "0:0"), f"job {job}: {state} {code}\n{output}"
    _assert_trained(tmp_path, output)


def _wait_for_job(job: str, env: dict[str, str], timeout: float) -> tuple[str, str]:
    """The final JobState and ExitCode of `job` (polled: sbatch --wait polls slowly)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = subprocess.run(["scontrol", "show", "job", "-o", job], env=env,
                              capture_output=True, text=True).stdout
        state = re.search(r"JobState=(\S+)", info)
        if state and state.group(1) not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return state.group(1), re.search(r"ExitCode=(\S+)", info).group(1)
        time.sleep(0.5)
    raise AssertionError(f"SLURM job {job} did not finish within {timeout:.0f}s")
