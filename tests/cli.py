"""Running the `dtrain` command as a user would, in a subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable

TINY_MODEL = """
[model]
n_layer = 1
n_head = 2
n_embd = 32
block_size = 32
"""
"""The smallest GPT of the command-line tests' configs (a few seconds a run)."""


def dtrain(*args: str, timeout: float = 120, cwd: str | None = None,
           env: dict[str, str] | None = None,
           preexec: Callable[[], None] | None = None) -> subprocess.CompletedProcess:
    """Run `dtrain ARGS` (extra `env`; `preexec` runs in the child before it starts)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "dtrain.cli", *args], capture_output=True, text=True,
        timeout=timeout, env=env, cwd=cwd, preexec_fn=preexec,
    )


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The single `dtrain: error:` line of stderr; fails if there is a traceback."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("dtrain: error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
