"""A `dtrain` command left running in the background, as `subprocess.Popen([python, -m,
dtrain.cli, ...], start_new_session=True)` would start it, but forked from the tests' fork
server (dtrain.testing.processes), where torch and dtrain are imported already: it starts in
milliseconds instead of the seconds of an import (a launcher started again in a drill, one
that must join a rendezvous round in time). Optionally inside a network namespace, as `ip
netns exec NS` would run it (tests/launch/test_multihost.py's hosts).

The command is its own process in its own session (a process group a test can kill at
once), with its own environment, working folder, standard streams and exit code; the ranks
it launches are new processes as always.
"""

from __future__ import annotations

import ctypes
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from dtrain.testing import fork_server

CLONE_NEWNET = 0x40000000


class Launched:
    """The forked command, with the part of Popen's interface the tests use."""

    def __init__(self, process, args: list[str]) -> None:
        self.process, self.args = process, args

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code (negative: the signal that killed it); raises
        subprocess.TimeoutExpired if it still runs after `timeout` seconds."""
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.process.exitcode


def start(args: list[str], *, env: dict[str, str], out: Path, err: Path | None = None,
          cwd: Path | None = None, netns: str | None = None) -> Launched:
    """`dtrain ARGS` with exactly `env`, in `cwd`, stdout into `out` and stderr into `err`
    (into `out` too when None), in network namespace `netns` when given."""
    for path in (out, err):  # there (empty) once this returns, as Popen's files would be
        if path is not None:
            Path(path).write_text("")
    process = fork_server().Process(
        target=_main, args=(list(args), dict(env), str(cwd) if cwd else None, str(out),
                            str(err) if err else None, netns),
        daemon=True)  # one a failed test left running is stopped (SIGTERM) as pytest exits
    process.start()
    return Launched(process, ["dtrain", *args])


def _main(args: list[str], env: dict[str, str], cwd: str | None, out: str, err: str | None,
          netns: str | None) -> None:
    """In the forked process: a session of its own, the namespace, environment, folder and
    streams it was given, then the CLI's main, whose return value is the exit code."""
    os.setsid()
    if netns is not None:
        enter(netns)
    run_cli(args, env, cwd, out, err)


def enter(netns: str) -> None:
    """Move this process into network namespace `netns`, as `ip netns exec` would (for a
    single-threaded one, a child just forked: other threads would stay where they were)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), f"setns into {netns}")
    os.close(fd)


def wait_all(launched: list[Launched], timeout: float, outputs: list[Path]) -> str:
    """Wait for every command of `launched`, each up to `timeout` seconds, then kill any
    still running (its whole session); fails unless all exited 0. Returns the `outputs`
    files' text, joined."""
    try:
        codes = [proc.wait(timeout=timeout) for proc in launched]
    finally:
        for proc in launched:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    said = "".join(out.read_text(errors="replace") for out in outputs)
    assert codes == [0] * len(launched), said
    return said


def run_cli(args: list[str], env: dict[str, str], cwd: str | None, out: str,
            err: str | None) -> None:
    """In a forked process: the environment, folder and streams it was given (standard
    error into `out` too when `err` is None), then the CLI's main, whose return value is
    the process's exit code."""
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    sys.path[0] = os.getcwd()  # as `python -m` puts the working folder first
    with open(out, "a") as f:
        os.dup2(f.fileno(), 1)
    if err is None:
        os.dup2(1, 2)
    else:
        with open(err, "a") as f:
            os.dup2(f.fileno(), 2)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), line_buffering=True)
    sys.argv = ["dtrain", *args]
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    from dtrain import cli

    code = cli.main(args)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
