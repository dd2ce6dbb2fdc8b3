"""dtrain.comm on gloo with real processes: the matrix, sub-groups, mismatches, timeouts."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import dtrain
from dtrain import comm
from dtrain.testing import run_ranks
from tests.support.comm_cases import all_gather_in_place, cases, check, check_in_place, exercise

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64)
LENGTHS = (0, 1, 7, 1_000_003)


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")  # tests/conftest.py


def _matrix(size: int, todo: list) -> list:
    return exercise(dist.get_rank(), size, todo)


# 3-5 ranks (oversubscribing CI's 2 cores) run with `make test-slow`; the same matrix runs
# in-process on 1-4 ranks, 3 a non-power of two (test_comm_threads), and on gloo here on 1-2.
@pytest.mark.parametrize("size", [1, 2, pytest.param(3, marks=pytest.mark.slow),
                                  pytest.param(4, marks=pytest.mark.slow),
                                  pytest.param(5, marks=pytest.mark.slow)])
def test_matrix_on_gloo(size: int) -> None:
    todo = cases(DTYPES, LENGTHS)
    check(run_ranks(_matrix, size, size, todo, timeout=170), size, todo)


def _in_place(size: int) -> list:
    return all_gather_in_place(dist.get_rank(), size)


def test_all_gather_in_place_on_gloo() -> None:
    """gloo's own all-gather (and dtrain's ring) with `tensor` this rank's part of `out`."""
    check_in_place(run_ranks(_in_place, 3, 3, timeout=120), 3)


def _subgroups() -> dict:
    mesh = dtrain.Mesh(tp=2)
    out = {}
    for axis in ("tp", "dp"):
        for algorithm in comm.AVAILABLE["all_reduce"]:
            t = torch.tensor([float(dist.get_rank())] * 3)
            out[(axis, algorithm)] = comm.all_reduce(t, group=mesh.group(axis),
                                                     algorithm=algorithm)[0].item()
        out[(axis, "gather")] = comm.all_gather(torch.tensor([dist.get_rank()]),
                                                group=mesh.group(axis)).tolist()
    return out


@pytest.mark.slow
def test_mesh_subgroups_reduce_only_within_themselves() -> None:
    results = run_ranks(_subgroups, 4)
    for rank, result in enumerate(results):
        tp_sum = 1.0 if rank < 2 else 5.0  # tp groups {0,1}, {2,3}
        dp_sum = 2.0 if rank % 2 == 0 else 4.0  # dp groups {0,2}, {1,3}
        for algorithm in comm.AVAILABLE["all_reduce"]:
            assert result[("tp", algorithm)] == tp_sum
            assert result[("dp", algorithm)] == dp_sum
        assert result[("tp", "gather")] == ([0, 1] if rank < 2 else [2, 3])
        assert result[("dp", "gather")] == ([0, 2] if rank % 2 == 0 else [1, 3])


def _mismatch() -> str:
    rank = dist.get_rank()
    try:
        if rank == 1:
            comm.all_reduce(torch.ones(4, 3))
        elif rank == 2:
            comm.broadcast(torch.ones(4, 4))
        else:
            comm.all_reduce(torch.ones(4, 4))
    except comm.CollectiveMismatch as exc:
        return str(exc)
    return "no error"


def test_debug_mode_every_rank_names_the_first_differing_rank() -> None:
    messages = run_ranks(_mismatch, 3, env={"DTRAIN_DEBUG": "1"})
    for message in messages:
        assert "rank 1 has size of dim 1 3 but rank 0 has 4" in message


def _op_mismatch() -> str:
    try:
        if dist.get_rank() == 1:
            comm.reduce(torch.ones(4))
        else:
            comm.all_reduce(torch.ones(4))
    except comm.CollectiveMismatch as exc:
        return str(exc)
    return "no error"


def test_debug_mode_names_a_different_operation() -> None:
    for message in run_ranks(_op_mismatch, 2, env={"DTRAIN_DEBUG": "1"}):
        assert "rank 1 has operation reduce but rank 0 has all_reduce" in message


def _absent_rank(algorithm: str) -> str:
    # The test's own store, beside the job's: rank 1 stays away until the others have
    # their diagnosis, however slowly a loaded machine starts them.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=60))
    if dist.get_rank() == 1:
        store.wait(["diagnosed/0", "diagnosed/2"])
        return "absent"
    try:
        comm.all_reduce(torch.ones(1000), algorithm=algorithm)
    except comm.CollectiveTimeout as exc:
        return str(exc)
    finally:
        store.set(f"diagnosed/{dist.get_rank()}", "1")
    return "no error"


@pytest.mark.parametrize("algorithm", [pytest.param("native", marks=pytest.mark.slow), "ring"])
def test_timeout_names_the_rank_that_never_arrived(algorithm: str) -> None:
    results = run_ranks(_absent_rank, 3, algorithm, collective_timeout=2)
    for rank in (0, 2):
        assert "never arrived: rank 1 (no report" in results[rank], results[rank]
        assert "all_reduce #1" in results[rank]


def _rank_that_leaves(algorithm: str) -> str:  # point-to-point through dtrain
    # Rank 1 leaves once rank 0 has joined the world: gloo's connectFullMesh ends on each
    # rank on its own, and a rank 1 gone before a loaded rank 0 finished its half failed
    # rank 0's dtrain.init() ("connectFullMesh failed ... Connection closed by peer").
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=60))
    if dist.get_rank() == 1:
        store.wait(["joined/0"])
        return "left"  # its process exits and closes its connections
    store.set("joined/0", "1")
    try:
        comm.all_reduce(torch.ones(1000), algorithm=algorithm)
    except comm.CollectiveTimeout as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("algorithm", ["ring", "tree"])  # the ring sends first, the tree
def test_a_rank_that_exits_is_named(algorithm: str) -> None:  # receives first on rank 0
    result = run_ranks(_rank_that_leaves, 2, algorithm, collective_timeout=10)[0]
    assert "all_reduce #1" in result and "never arrived: rank 1 (no report" in result, result
