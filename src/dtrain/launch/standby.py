"""A rank's warm standby under live replicas: `python -m dtrain.launch.standby TARGET...`,
started by the rank's supervisor (dtrain.launch.supervisor) beside the running rank.

A replacement rank spends most of its seconds before it can ask a live peer for the state
on things that do not depend on which rank it replaces: starting Python, importing torch
and the trainer, and importing torch's compiler stack, which the first optimizer built
imports (`torch.optim.Optimizer.add_param_group` is wrapped by `torch._disable_dynamo`).
On a loaded machine that is seconds: the replacement shares the cores with the survivors.
So each supervisor keeps one process that has done all of it ahead of time and then
waits, using no CPU, for one line on its stdin: the environment the new rank runs in
(its generation and attempt, set by the supervisor; the rest is the supervisor's, as the
standby's was at its start). It then runs TARGET (SCRIPT ARGS or -m MODULE ARGS) exactly
as dtrain.launch.bootstrap runs a fresh rank. Stdin closed without a line ends it with
status 0; a supervisor that no longer needs it (its rank ended) kills it; and it dies with
its supervisor, as a rank does.

Nothing it reads is unpickled: the line is JSON, from its parent through a pipe.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping

from dtrain import env
from dtrain.launch import bootstrap

MODULE = "dtrain.launch.standby"


class Ready:
    """The pipe through which a rank tells its supervisor, once, that it has taken part in
    a step (env LIVE_READY_FD, written by dtrain.ft.live.job): the job's start is over,
    and a standby importing beside the rank no longer slows it."""

    def __init__(self) -> None:
        self._read, self.write = os.pipe()
        os.set_blocking(self._read, False)
        self._seen = False

    def environ(self, base: Mapping[str, str]) -> dict[str, str]:
        """`base` and the variable that names the pipe to the rank."""
        return {**base, **env.LIVE_READY_FD.pair(self.write)}

    def handed(self) -> None:
        """The rank holds the writing end now (inherited): close this process's."""
        os.close(self.write)

    def seen(self) -> bool:
        """Whether the rank has said it trains (it may have died since)."""
        if not self._seen:
            try:
                self._seen = os.read(self._read, 1) == b"1"
            except BlockingIOError:
                pass
        return self._seen

    def close(self) -> None:
        os.close(self._read)


def start(argv: list[str]) -> tuple[subprocess.Popen, Ready]:
    """A fresh process for the rank `argv`, and its Ready pipe."""
    ready = Ready()
    child = subprocess.Popen(bootstrap.command(argv), pass_fds=(ready.write,),
                             env=ready.environ(os.environ))
    ready.handed()
    return child, ready


class Standby:
    """One standby process for the rank `argv` (a Python command; see `of`)."""

    def __init__(self, interpreter: list[str], target: list[str]) -> None:
        self._ready = Ready()
        self._proc = subprocess.Popen([*interpreter, "-m", MODULE, *target],
                                      stdin=subprocess.PIPE, pass_fds=(self._ready.write,))

    @classmethod
    def of(cls, argv: list[str]) -> Standby | None:
        """A standby for the rank command `argv`; None when it is not a Python program
        (a standby can only warm a Python interpreter)."""
        parts = bootstrap.split(argv)
        return None if parts is None else cls(*parts)

    def take(self, environ: Mapping[str, str]) -> tuple[subprocess.Popen, Ready] | None:
        """The standby, now running the rank in `environ`, and its Ready pipe; None if it
        died meanwhile (then closed)."""
        assert self._proc.stdin is not None  # opened with a pipe
        line = json.dumps({"env": self._ready.environ(environ)}).encode() + b"\n"
        try:
            if self._proc.poll() is None:
                self._proc.stdin.write(line)
                self._proc.stdin.close()
                self._ready.handed()
                return self._proc, self._ready
        except BrokenPipeError:  # it died as the line went
            pass
        self.close()
        return None

    def close(self) -> None:
        """Stop the standby (it holds nothing: imports, perhaps half done) and reap it."""
        assert self._proc.stdin is not None
        self._proc.kill()
        self._proc.wait()
        try:
            self._proc.stdin.close()
        except BrokenPipeError:
            pass
        self._ready.handed()
        self._ready.close()


def warm(target: list[str]) -> None:
    """Import what the rank `target` imports before it trains: torch, its compiler stack
    (which the first optimizer constructed imports), and what the module it runs imports
    (the module's body runs, its main kept under `if __name__ == "__main__"`; the module
    itself is forgotten again, to run as `__main__` later as a fresh rank's does)."""
    import torch._dynamo  # noqa: F401  # (torch with it)

    if target[0] == "-m" and len(target) > 1:
        importlib.import_module(target[1])
        del sys.modules[target[1]]


def main(target: list[str]) -> int:
    bootstrap.die_with_parent()
    warm(target)
    line = sys.stdin.buffer.readline()
    if not line:
        return 0  # not needed
    message = json.loads(line)
    environ = message["env"]
    if not isinstance(environ, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in environ.items()):
        sys.exit(f"{MODULE}: the environment sent is not a map of strings")
    os.environ.clear()
    os.environ.update(environ)
    devnull = os.open(os.devnull, os.O_RDONLY)  # the rank's stdin: as a fresh rank's would
    os.dup2(devnull, 0)                        # read nothing, not the spent pipe
    os.close(devnull)
    bootstrap.main(target)
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(f"usage: python -m {MODULE} SCRIPT|-m MODULE [ARGS...]")
    sys.exit(main(sys.argv[1:]))
