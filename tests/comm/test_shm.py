"""The shm backend: the collective matrix over shared memory, bitwise agreement, a dead
peer named, sleeping waiters, DataParallel on it, and nothing left in /dev/shm."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dtrain import comm
from dtrain.comm.algorithms.hierarchical import HierarchicalGroup
from dtrain.comm.shm import ShmGroup, segment
from dtrain.testing import fork_server, run_ranks
from tests.data_parallel.test_data_parallel import (
    STEPS,
    assert_matches,
    train_ranks,
    train_reference,
)
from tests.support.cli import dtrain, free_port
from tests.support.comm_cases import cases, check, exercise

SHM = {"DTRAIN_BACKEND": "shm"}
SMALL_SLOTS = {**SHM, "DTRAIN_SHM_SLOT_MB": "0.0625"}  # 64 KiB: long tensors take many steps
DTYPES = (torch.float32, torch.bfloat16, torch.int32, torch.int64)
LENGTHS = (0, 1, 7, 1_000_003)


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")  # tests/conftest.py


SHM_OPS = {"all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "barrier"}
"""The collectives the shm transport moves itself; scatter, gather and all_to_all go
through the gloo group beneath (dtrain.comm.shm)."""


def _carried(fn: Callable[..., Any], *args: Any) -> tuple[Any, dict[str, Counter]]:
    """`fn(*args)` on this rank, and what carried its collectives: the world's shm group
    ("shm": its native calls by operation) and the gloo group beneath it ("gloo": its
    native calls by operation, and its point-to-point messages)."""
    world = comm.resolve(None)
    assert isinstance(world, ShmGroup), type(world).__name__
    counts: dict[str, Counter] = {"shm": Counter(), "gloo": Counter()}

    def counted(method: Callable[..., Any], counter: Counter, what: str | None = None):
        def call(*a: Any, **kw: Any) -> Any:
            counter[what or a[0]] += 1
            return method(*a, **kw)
        return call

    world.native = counted(world.native, counts["shm"])
    world.below.native = counted(world.below.native, counts["gloo"])
    world.below.isend = counted(world.below.isend, counts["gloo"], "isend")
    world.below.irecv = counted(world.below.irecv, counts["gloo"], "irecv")
    try:
        return fn(*args), counts
    finally:
        for obj, name in ((world, "native"), (world.below, "native"),
                          (world.below, "isend"), (world.below, "irecv")):
            delattr(obj, name)


def _matrix(size: int, todo: list) -> list:
    return exercise(dist.get_rank(), size, todo)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_matrix_on_shm(size: int) -> None:
    todo = [case for case in cases(DTYPES, LENGTHS) if case[1] == "native"]
    ranks = run_ranks(_carried, size, _matrix, size, todo, timeout=170, env=SMALL_SLOTS)
    check([results for results, _ in ranks], size, todo)
    ops = {case[0] for case in todo if case[3] > 0}  # an empty tensor sends nothing
    for _, counts in ranks:  # shm moved its collectives; gloo only the others
        assert ops <= set(counts["shm"]), counts
        assert set(counts["gloo"]) <= ops - SHM_OPS, counts


def _sums() -> list[torch.Tensor]:
    rank = dist.get_rank()
    out = []
    for length in (5, 40_000, 300_007):  # one step, one small-path step, many chunks
        x = torch.randn(length, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
        out.append(comm.all_reduce(x.float(), algorithm="native"))
    return out


def test_every_rank_holds_the_same_bits() -> None:
    ranks = run_ranks(_carried, 3, _sums, env=SMALL_SLOTS)
    results = [sums for sums, _ in ranks]
    for mine in results[1:]:
        for a, b in zip(results[0], mine, strict=True):
            assert torch.equal(a, b)
    for _, counts in ranks:  # the three sums went through shared memory, none through gloo
        assert counts == {"shm": Counter(all_reduce=3), "gloo": Counter()}, counts


def _dies() -> str:
    comm.barrier()  # the segment is set up by then
    if dist.get_rank() == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(10), algorithm="native")
    except comm.CollectiveTimeout as exc:
        return f"{time.monotonic() - start:.1f}s {exc}"
    return "no error"


def test_a_dead_rank_is_named_long_before_the_timeout() -> None:
    for message in _survivor_messages():
        seconds, _, text = message.partition(" ")
        assert "rank 1 (pid" in text and "exited" in text, text
        assert float(seconds.rstrip("s")) < 10  # the timeout is 60 s


def _survivor_messages() -> list[str]:
    """Ranks 0 and 2's errors when rank 1 dies (run_ranks would stop at its exit); the ranks
    are forked from the tests' fork server, where torch and dtrain are imported already."""
    ctx = fork_server()
    out = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    procs = []
    for rank in range(3):
        env = {"RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
               "DTRAIN_TIMEOUT": "60", **SHM}
        proc = ctx.Process(target=_survivor, args=(rank, env, out), daemon=True)
        proc.start()
        procs.append(proc)
    messages = [out.get(timeout=60) for _ in range(2)]
    for proc in procs:
        proc.join(timeout=10)
    return messages


def _survivor(rank: int, env: dict, out) -> None:
    os.environ.update(env)
    import dtrain

    dtrain.init()
    out.put(_dies())
    out.close()
    out.join_thread()  # the queue's feeder thread has sent it
    os._exit(0)  # the job is broken: leave without the teardown collectives


def _sleepy_barrier() -> float:
    if dist.get_rank() == 1:
        time.sleep(2.0)
    start = time.process_time()
    comm.barrier()
    return time.process_time() - start


def test_a_waiting_rank_sleeps_instead_of_spinning() -> None:
    ranks = run_ranks(_carried, 2, _sleepy_barrier, env=SHM)
    cpu_seconds = [seconds for seconds, _ in ranks]
    assert cpu_seconds[0] < 0.5, cpu_seconds  # two seconds of waiting
    for _, counts in ranks:  # in shm's barrier, not gloo's
        assert counts == {"shm": Counter(barrier=1), "gloo": Counter()}, counts


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_data_parallel_on_shm_equals_single_process(world_size: int) -> None:
    """The native algorithm: "auto" may pick the ring, whose messages go through gloo."""
    ranks = run_ranks(_carried, world_size, train_ranks, "plain", 0.002, 1, "native", env=SHM)
    assert_matches([result for result, _ in ranks], train_reference("plain", world_size, 1))
    for _, counts in ranks:  # every gradient bucket averaged in shared memory, none on gloo
        assert counts["shm"]["all_reduce"] >= STEPS, counts  # a bucket or more a step
        assert counts["gloo"] == Counter(), counts


def test_config_and_launcher_accept_shm(tmp_path: Path) -> None:
    from dtrain.config import load_config

    assert load_config(None, ["comm.backend=shm"]).comm.backend == "shm"
    result = dtrain("run", "--backend", "tcp", str(tmp_path / "x.py"))
    assert result.returncode == 2 and "'tcp'" in result.stderr


def _dtrain_segments() -> set[str]:
    return {p.name for p in segment.SHM_DIR.glob(f"{segment.PREFIX}*")}


SCRIPT = """
import os, signal, sys, torch, dtrain
from dtrain import comm
from dtrain.comm.shm import segment
world = dtrain.init()
x = torch.full((100_000,), float(world.rank))
comm.all_reduce(x)
assert x[0].item() == sum(range(world.world_size)), x[0]
if sys.argv[1] == "kill" and world.rank == 1:
    (segment.SHM_DIR / segment.new_name("left")).write_bytes(b"x")  # as if killed in set-up
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[1] == "kill":
    comm.barrier()  # rank 1 never comes
print("done", world.rank, type(comm.resolve(None)).__name__)
"""


@pytest.mark.parametrize("how", ["ok", "kill"])
def test_nothing_is_left_in_dev_shm(tmp_path: Path, how: str) -> None:
    """A job that ends well, and one whose rank 1 is SIGKILLed while rank 0 waits for it in
    a barrier, having named a segment it never mapped (as if killed in its set-up): the
    segments in use and the one only named are all removed."""
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    before = _dtrain_segments()
    result = dtrain("run", "-n", "2", "--backend", "shm", str(path), how, timeout=120)
    if how == "ok":
        assert result.returncode == 0, result.stderr
        assert "[rank0] done 0 ShmGroup" in result.stdout
    else:
        assert result.returncode == 128 + signal.SIGKILL, result.stderr
        assert "rank 1 was killed by SIGKILL" in result.stderr
    assert _dtrain_segments() - before == set()


HIER = """
import sys, torch, torch.distributed as dist, dtrain
from dtrain import comm
world = dtrain.init(backend="shm")
group = comm.resolve(None)
ints = torch.arange(1_000_003, dtype=torch.int64) * (world.rank + 1)
flat = ints.clone(); dist.all_reduce(flat)
comm.all_reduce(ints, algorithm="native")
assert torch.equal(ints, flat)
floats = torch.randn(300_001, generator=torch.Generator().manual_seed(world.rank))
flat = floats.clone(); dist.all_reduce(flat)
comm.all_reduce(floats, algorithm="native")
torch.testing.assert_close(floats, flat)
torch.save(floats, f"{sys.argv[1]}/rank{world.rank}.pt")
print("hier", world.rank, type(group).__name__, type(group.local).__name__)
"""


@pytest.mark.slow
def test_hierarchical_all_reduce_over_two_hosts_equals_the_flat_one(tmp_path: Path) -> None:
    path = tmp_path / "hier.py"
    path.write_text(HIER)
    flags = ["--nnodes", "2", "--master", f"127.0.0.1:{free_port()}", "-n", "2",
             "--join-timeout", "60"]
    other = subprocess.Popen(
        [sys.executable, "-m", "dtrain.cli", "run", "--node-rank", "1", *flags, str(path),
         str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    first = dtrain("run", "--node-rank", "0", *flags, str(path), str(tmp_path))
    out, err = other.communicate(timeout=120)
    assert first.returncode == 0 and other.returncode == 0, first.stderr + err
    assert f"[rank0] hier 0 {HierarchicalGroup.__name__} ShmGroup" in first.stdout
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    for other_result in results[1:]:
        assert torch.equal(results[0], other_result)  # the same bits on both hosts
