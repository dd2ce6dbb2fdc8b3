"""`dtrain run`: ranks start, output is prefixed, failures are named, nothing is left behind."""

from __future__ import annotations

import os
import signal
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support import forked
from tests.support.cli import dtrain, free_port, one_error_line
from tests.support.paths import EXAMPLES
from tests.support.poll import until

HELLO = """
import dtrain, torch, torch.distributed as dist
w = dtrain.init()
t = torch.tensor([float(w.rank)])
dist.all_reduce(t)
print(f"rank={w.rank} size={w.world_size} local={w.local_rank} node={w.node_rank} sum={t.item()}")
"""


def script(tmp_path: Path, body: str, name: str = "job.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_ranks_run_with_prefixed_output(tmp_path: Path) -> None:
    result = dtrain("run", "-n", "2", script(tmp_path, HELLO))
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        assert f"[rank{rank}] rank={rank} size=2 local={rank} node=0 sum=1.0" in result.stdout


def test_failed_rank_is_named_first_and_all_stop_quickly(tmp_path: Path) -> None:
    """Rank 1 exits with code 3. Rank 0 fails too, on its own (exit code 5, when the agent
    stops it), after rank 1; rank 2, busy elsewhere, must be stopped by the launcher: the
    exit times the ranks note (dtrain.launch.exits) name rank 1, and every rank is stopped
    within seconds of its exit."""
    exited = tmp_path / "exited"
    body = f"""
    import signal, sys, time, dtrain, torch.distributed as dist
    w = dtrain.init()
    if w.rank == 0:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(5))
    dist.barrier()
    if w.rank == 1:
        open({str(exited)!r}, "w").write(repr(time.time()))
        raise SystemExit(3)
    time.sleep(600)   # ranks 0 and 2 are busy elsewhere: the launcher must stop them
    """
    result = dtrain("run", "-n", "3", script(tmp_path, body), timeout=60)
    stopped = time.time() - float(exited.read_text())
    assert result.returncode == 3, result.stderr
    assert "rank 1 exited with code 3 (2 other ranks failed too)" in one_error_line(result)
    assert stopped < 15  # 10 s to stop, and a loaded 2-core machine's slack


def test_a_rank_runs_its_script_as_python_would(tmp_path: Path) -> None:
    """Ranks start through dtrain.launch.bootstrap (to die with the launcher and note their
    exit), yet the script sees what `python script.py ARGS` shows it: its argv, its own
    `__main__`, its folder first on sys.path, and a traceback of its frames only, shown
    once, prefixed, above the launcher's line naming the rank."""
    (tmp_path / "helper.py").write_text("VALUE = 7\n")
    body = """
    import sys, dtrain, helper
    dtrain.init()
    main = sys.modules["__main__"]
    print("argv", sys.argv[1:], __name__, main.__file__ == __file__, main.__spec__,
          sys.path[0])
    raise ValueError(helper.VALUE)
    """
    result = dtrain("run", "-n", "1", script(tmp_path, body), "a", "b", timeout=60)
    assert result.returncode == 1, result.stderr
    folder = os.path.realpath(tmp_path)
    assert f"[rank0] argv ['a', 'b'] __main__ True None {folder}" in result.stdout
    assert result.stderr.count("[rank0] ValueError: 7") == 1, result.stderr
    assert "[rank0] [rank0]" not in result.stderr
    assert result.stderr.strip().endswith("rank 0 exited with code 1; its output is above")
    assert "bootstrap" not in result.stderr and "runpy" not in result.stderr


def test_two_nodes_on_loopback(tmp_path: Path) -> None:
    path, master = script(tmp_path, HELLO), f"127.0.0.1:{free_port()}"
    flags = ["--nnodes", "2", "--master", master, "-n", "2", "--join-timeout", "60"]
    with ThreadPoolExecutor(1) as pool:  # the other machine's launcher, beside this one
        other = pool.submit(dtrain, "run", "--node-rank", "1", *flags, path)
        first = dtrain("run", "--node-rank", "0", *flags, path)
        second = other.result(timeout=60)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert "[rank2] rank=2 size=4 local=0 node=1 sum=6.0" in second.stdout
    assert "[rank1] rank=1 size=4 local=1 node=0 sum=6.0" in first.stdout


def test_unreachable_master_is_one_line(tmp_path: Path) -> None:
    master = f"127.0.0.1:{free_port()}"
    result = dtrain("run", "--nnodes", "2", "--node-rank", "1", "--master", master,
                    "--join-timeout", "1", "-n", "1", script(tmp_path, HELLO), timeout=60)
    assert result.returncode != 0
    assert "could not reach the master" in one_error_line(result)


def test_port_in_use_is_one_line(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        master = f"127.0.0.1:{busy.getsockname()[1]}"
        result = dtrain("run", "--nnodes", "2", "--node-rank", "0", "--master", master,
                        "--join-timeout", "5", "-n", "1", script(tmp_path, HELLO), timeout=60)
    assert result.returncode != 0
    assert "is in use" in one_error_line(result)


def test_ctrl_c_stops_every_rank(tmp_path: Path) -> None:
    marker = tmp_path / "pids"
    marker.mkdir()
    body = f"""
    import os, time, dtrain
    w = dtrain.init()
    open(os.path.join({str(marker)!r}, str(os.getpid())), "w").close()
    time.sleep(600)
    """
    err = tmp_path / "stderr"
    proc = forked.start(["run", "-n", "2", script(tmp_path, body)],  # in a session of its own
                        env={**os.environ, "OMP_NUM_THREADS": "1"}, out=tmp_path / "stdout",
                        err=err)
    until(lambda: len(list(marker.iterdir())) == 2, 60, "start of both ranks",
          running=[proc.poll], every=0.2)
    pids = [int(p.name) for p in marker.iterdir()]
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    assert proc.wait(timeout=30) == 130
    assert "stopped by SIGINT" in err.read_text()
    # the launcher has returned: its ranks go at once
    until(lambda: not any(_running(pid) for pid in pids), 10, "end of both ranks",
          every=0.05)


def _running(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "zombie" not in status.read_text()
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_data_parallel_example_trains() -> None:
    example = EXAMPLES / "data_parallel.py"
    result = dtrain("run", "-n", "2", str(example))
    assert result.returncode == 0, result.stderr
    last = [line for line in result.stdout.splitlines() if "epoch 4" in line]
    assert len(last) == 1 and float(last[0].rsplit(" ", 1)[1]) > 0.95


def test_rendezvous_events_are_named_as_torch_names_them() -> None:
    """The launcher names torch's rendezvous events from the frames (torch reads every
    frame's source for it): the same function name that inspect.stack() gives."""
    import inspect

    from dtrain.launch.rendezvous import _method_name

    def handler_method() -> tuple[str, str]:
        return recorder()

    def recorder() -> tuple[str, str]:  # as torch's _record: the name of who called it
        return _method_name(), inspect.stack()[1].function

    ours, torchs = handler_method()
    assert ours == torchs == "handler_method"
