"""Reading the world from each launcher's environment (the degrees that lay it out, and
the Mesh: tests/mesh/test_mesh.py)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dtrain
from dtrain import agreed_port
from dtrain.errors import ConfigError, DtrainError
from dtrain.world import detect, first_slurm_host


def test_no_launcher_is_a_one_process_world() -> None:
    world = detect({})
    assert (world.rank, world.world_size, world.local_rank, world.node_rank) == (0, 1, 0, 0)
    assert world.source == "single" and world.role == "worker"


def test_torchrun_env() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    world = detect(env)
    assert (world.rank, world.world_size, world.local_rank, world.local_world_size) == (5, 8, 1, 4)
    assert (world.node_rank, world.master_addr, world.master_port) == (1, "10.0.0.1", 1234)
    assert world.source == "torchrun"
    assert detect({**env, "DTRAIN_RUN_ID": "x", "DTRAIN_ROLE": "server"}).source == "dtrain"
    assert detect({**env, "DTRAIN_ROLE": "server"}).role == "server"


def test_slurm_env() -> None:
    env = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2",
           "SLURM_NTASKS_PER_NODE": "4", "SLURM_NODEID": "1",
           "SLURM_JOB_NODELIST": "gpu[07-08],cpu1", "SLURM_JOB_ID": "123456"}
    world = detect(env)
    assert (world.rank, world.world_size, world.local_rank, world.local_world_size) == (6, 8, 2, 4)
    assert world.node_rank == 1 and world.source == "slurm"
    assert world.master_addr == "gpu07"
    assert world.master_port == 10000 + 123456 % 20000
    assert detect({**env, "MASTER_PORT": "777", "MASTER_ADDR": "h"}).master_port == 777


@pytest.mark.parametrize("nodelist, first", [
    ("node01", "node01"), ("node[01-04,07],gpu5", "node01"), ("a[3,5]-b[10-12]", "a3-b10"),
    ("gpu5,node[1-2]", "gpu5"),
])
def test_first_slurm_host(nodelist: str, first: str) -> None:
    assert first_slurm_host(nodelist) == first


def test_openmpi_env() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "MASTER_ADDR": "host0"}
    world = detect(env)
    assert (world.rank, world.world_size, world.local_rank, world.node_rank) == (3, 4, 1, 1)
    assert world.source == "openmpi" and world.master_addr == "host0"


def test_mpich_env() -> None:
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
           "MASTER_ADDR": "h"}
    world = detect(env)
    assert (world.rank, world.world_size, world.local_rank, world.source) == (1, 2, 1, "mpich")


OMPI_ONE_MACHINE = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                    "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                    "PMIX_NAMESPACE": "prterun-vm-81@1", "OMPI_MCA_ess_base_jobid": "77"}


def test_mpi_on_one_machine_agrees_a_port_on_loopback() -> None:
    world = detect(OMPI_ONE_MACHINE)
    assert (world.rank, world.world_size, world.source) == (1, 2, "openmpi")
    assert (world.master_addr, world.master_port) == ("127.0.0.1", 0)
    assert world.port_key == "openmpi-prterun-vm-81@1"
    no_pmix = {k: v for k, v in OMPI_ONE_MACHINE.items() if k != "PMIX_NAMESPACE"}
    assert detect(no_pmix).port_key == "openmpi-77"  # Open MPI 4 sets both
    chosen = detect({**OMPI_ONE_MACHINE, "MASTER_PORT": "4321"})
    assert (chosen.master_addr, chosen.master_port, chosen.port_key) == ("127.0.0.1", 4321, "")
    given = detect({**OMPI_ONE_MACHINE, "MASTER_ADDR": "h"})
    assert (given.master_addr, given.master_port, given.port_key) == ("h", 29500, "")


def test_mpi_across_machines_without_master_addr_says_what_to_set() -> None:
    across = {**OMPI_ONE_MACHINE, "OMPI_COMM_WORLD_SIZE": "4"}
    with pytest.raises(DtrainError, match="started 4 ranks on several machines \\(2 on this "
                                          "one\\) but MASTER_ADDR is not set: export"):
        detect(across)
    assert detect({**across, "MASTER_ADDR": "node0"}).master_addr == "node0"
    with pytest.raises(DtrainError, match="no job name .* export MASTER_PORT"):
        detect({"PMI_RANK": "0", "PMI_SIZE": "2"})
    assert detect({"PMI_RANK": "0", "PMI_SIZE": "1"}).world_size == 1


def test_slurm_on_one_node_agrees_a_port() -> None:
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
           "SLURM_TASKS_PER_NODE": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "vm",
           "SLURM_JOB_ID": "12", "SLURM_STEP_ID": "3", "SLURM_STEP_NUM_NODES": "1"}
    world = detect(env)
    assert (world.master_addr, world.master_port, world.port_key) == ("127.0.0.1", 0,
                                                                      "slurm-12.3")
    assert world.describe() == "rank 1 of 2 from SLURM (job 12, node 0)"
    set_by_user = detect({**env, "MASTER_ADDR": "vm", "MASTER_PORT": "5"})
    assert (set_by_user.master_addr, set_by_user.master_port, set_by_user.port_key) == (
        "vm", 5, "")


def test_describe_names_the_launcher() -> None:
    assert detect({}).describe() == "one process"
    assert detect(OMPI_ONE_MACHINE).describe() == "rank 1 of 2 from Open MPI (node 0)"
    torchrun = detect({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"})
    assert torchrun.describe() == "rank 3 of 4 from torchrun (node 1)"


@pytest.fixture
def port_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The folder of port files, inside this test's own temporary folder."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return agreed_port.folder()


@pytest.mark.timeout(30)
def test_ranks_agree_the_port_rank_0_picked_and_the_file_goes(port_files: Path) -> None:
    joined: dict[int, int] = {}

    def join(rank: int) -> None:
        store = agreed_port.local_store("job-1", rank, 3, timedelta(seconds=20))
        store.set(f"rank{rank}", "here")
        joined[rank] = store.port

    threads = [threading.Thread(target=join, args=(r,)) for r in (1, 2, 0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=25)
    assert sorted(joined) == [0, 1, 2] and len(set(joined.values())) == 1, joined
    assert joined[0] != 0
    assert list(port_files.iterdir()) == [], "rank 0 removes its port file"
    assert port_files.stat().st_mode & 0o777 == 0o700


@pytest.mark.timeout(30)
def test_a_rank_without_rank_0_says_where_it_waited(port_files: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = agreed_port.port_file("job/2")  # left by a job that is gone: not used
    stale.write_text(f"1 {gone.stdout.strip()}\n")
    with pytest.raises(DtrainError, match=f"rank 1 waited 0.3s for rank 0 to publish its port "
                                          f"in {stale}: check that rank 0 runs"):
        agreed_port.local_store("job/2", 1, 2, timedelta(seconds=0.3))


def test_port_folder_must_be_private(port_files: Path) -> None:
    port_files.chmod(0o777)
    with pytest.raises(DtrainError, match="is not private to this user"):
        agreed_port.folder()


def test_malformed_variable_is_named() -> None:
    with pytest.raises(DtrainError, match="WORLD_SIZE='two'"):
        detect({"RANK": "0", "WORLD_SIZE": "two"})


def test_single_process_world_runs_collectives() -> None:
    world = dtrain.init()
    try:
        t = torch.ones(3)
        dist.all_reduce(t)
        assert world.world_size == 1 and torch.equal(t, torch.ones(3))
        assert dtrain.Mesh().size("dp") == 1
    finally:
        dtrain.shutdown()


def test_a_rank_that_leaves_while_the_group_forms_is_one_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """gloo connects every pair of ranks, each finishing its half alone: a rank that exits
    right after its half makes the other's init fail with gloo's "Connection closed by
    peer". That is one line saying what happened, not gloo's traceback."""
    def closed(*args, **kwargs) -> None:
        raise RuntimeError("Gloo connectFullMesh failed with [../third_party/gloo/gloo/"
                           "transport/tcp/pair.cc:553] Connection closed by peer "
                           "[127.0.0.1]:52916")

    monkeypatch.setattr(dist, "init_process_group", closed)
    monkeypatch.setattr(dtrain.world, "detect", lambda env: dtrain.world.World(
        rank=1, world_size=2, local_rank=1, local_world_size=2))
    with pytest.raises(DtrainError, match=r"^rank 1: another rank closed its connection "
                       r"while the ranks were connecting \(master 127.0.0.1:\d+\): it "
                       r"exited or failed during start-up") as err:
        dtrain.init(backend="gloo")
    assert "\n" not in str(err.value)


def test_nccl_with_more_ranks_than_gpus_on_the_host_says_what_to_change(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks of one host on one GPU: NCCL cannot put two ranks on one device, so
    dtrain.init refuses in one line (a ConfigError: exit 2 from the CLI) before it sets a
    device or joins a process group, naming the counts and what to change."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(dtrain.world, "detect", lambda env: dtrain.world.World(
        rank=0, world_size=2, local_rank=0, local_world_size=2))
    with pytest.raises(ConfigError, match=r"^2 ranks on this host but 1 GPU\(s\): NCCL needs "
                       r"a GPU of its own per rank; .*parallel.nproc.*gloo") as err:
        dtrain.init(backend="nccl")
    assert "\n" not in str(err.value)
    assert not dist.is_initialized()
