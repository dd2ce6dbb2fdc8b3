"""`dtrain run`: ranks start, output is prefixed, failures are named, nothing is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.cli import dtrain, free_port, one_error_line

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
    result = dtrain("run", "-n", "3", script(tmp_path, HELLO))
    assert result.returncode == 0, result.stderr
    for rank in range(3):
        assert f"[rank{rank}] rank={rank} size=3 local={rank} node=0 sum=3.0" in result.stdout


def test_failed_rank_is_named_and_all_stop_quickly(tmp_path: Path) -> None:
    body = """
    import time, dtrain, torch.distributed as dist
    w = dtrain.init()
    dist.barrier()
    if w.rank == 1:
        raise SystemExit(3)
    time.sleep(600)   # rank 0 is busy elsewhere: the launcher must stop it
    """
    start = time.monotonic()
    result = dtrain("run", "-n", "2", script(tmp_path, body), timeout=60)
    elapsed = time.monotonic() - start
    assert result.returncode == 3
    assert "rank 1 exited with code 3" in one_error_line(result)
    assert elapsed < 10 + 15  # 10 s to stop, generous start-up on a loaded 2-core machine


def test_the_rank_that_failed_first_is_named(tmp_path: Path) -> None:
    """Rank 0 fails too, on its own (exit code 5, when the agent stops it), after rank 1:
    the exit times the ranks note (dtrain.launch.exits) name rank 1."""
    body = """
    import signal, sys, time, dtrain, torch.distributed as dist
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(5))
    w = dtrain.init()
    dist.barrier()
    if w.rank == 1:
        raise SystemExit(3)
    time.sleep(600)
    """
    result = dtrain("run", "-n", "2", script(tmp_path, body), timeout=60)
    assert result.returncode == 3, result.stderr
    assert "rank 1 exited with code 3 (1 other rank failed too)" in one_error_line(result)


def test_exception_in_rank_shows_its_traceback_once_prefixed(tmp_path: Path) -> None:
    body = """
    import dtrain
    w = dtrain.init()
    if w.rank == 0:
        raise ValueError("bad batch")
    """
    result = dtrain("run", "-n", "2", script(tmp_path, body), timeout=60)
    assert result.returncode == 1
    assert "[rank0] ValueError: bad batch" in result.stderr
    assert "[rank0] [rank0]" not in result.stderr
    assert result.stderr.strip().endswith("rank 0 exited with code 1; its output is above")


def test_a_rank_runs_its_script_as_python_would(tmp_path: Path) -> None:
    """Ranks start through dtrain.launch.bootstrap (to die with the launcher and note their
    exit), yet the script sees what `python script.py ARGS` shows it: its argv, its own
    `__main__`, its folder first on sys.path, and a traceback of its frames only."""
    (tmp_path / "helper.py").write_text("VALUE = 7\n")
    body = """
    import sys, helper
    main = sys.modules["__main__"]
    print("argv", sys.argv[1:], __name__, main.__file__ == __file__, main.__spec__,
          sys.path[0])
    raise ValueError(helper.VALUE)
    """
    result = dtrain("run", "-n", "1", script(tmp_path, body), "a", "b", timeout=60)
    assert result.returncode == 1, result.stderr
    folder = os.path.realpath(tmp_path)
    assert f"[rank0] argv ['a', 'b'] __main__ True None {folder}" in result.stdout
    assert "[rank0] ValueError: 7" in result.stderr
    assert "bootstrap" not in result.stderr and "runpy" not in result.stderr


def test_two_nodes_on_loopback(tmp_path: Path) -> None:
    path, master = script(tmp_path, HELLO), f"127.0.0.1:{free_port()}"
    flags = ["--nnodes", "2", "--master", master, "-n", "2", "--join-timeout", "60"]
    other = subprocess.Popen(
        [sys.executable, "-m", "dtrain.cli", "run", "--node-rank", "1", *flags, path],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    first = dtrain("run", "--node-rank", "0", *flags, path)
    out, err = other.communicate(timeout=60)
    assert first.returncode == 0 and other.returncode == 0, first.stderr + err
    assert "[rank2] rank=2 size=4 local=0 node=1 sum=6.0" in out
    assert "[rank1] rank=1 size=4 local=1 node=0 sum=6.0" in first.stdout


def test_unreachable_master_is_one_line(tmp_path: Path) -> None:
    master = f"127.0.0.1:{free_port()}"
    result = dtrain("run", "--nnodes", "2", "--node-rank", "1", "--master", master,
                    "--join-timeout", "2", "-n", "1", script(tmp_path, HELLO), timeout=60)
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
    proc = subprocess.Popen(
        [sys.executable, "-m", "dtrain.cli", "run", "-n", "2", script(tmp_path, body)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while len(list(marker.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = [int(p.name) for p in marker.iterdir()]
    assert len(pids) == 2
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert "stopped by SIGINT" in err
    time.sleep(0.5)
    for pid in pids:
        status = Path(f"/proc/{pid}/status")
        assert not status.exists() or "zombie" in status.read_text()


@pytest.mark.slow
def test_data_parallel_example_trains() -> None:
    example = Path(__file__).parent.parent / "examples" / "data_parallel.py"
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
