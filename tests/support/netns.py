"""Machines simulated on one: network namespaces, each standing for a host, and what a
test started in them (tests/launch/test_multihost.py, tests/ft/test_host_loss.py). Needs root and
iproute2's `ip`; the tests that make namespaces skip, saying why, without them."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import forked


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run iproute2's `ip ARGS` (its output captured; `check`: raise if it fails)."""
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@dataclass
class Host:
    """A network namespace standing for one machine, and what the test started in it."""

    ns: str
    ifname: str
    addr: str
    procs: list[forked.Launched] = field(default_factory=list)

    def pids(self) -> list[int]:
        """Every process alive in this namespace (the host's agent and ranks)."""
        out = ip("netns", "pids", self.ns, check=False).stdout.split()
        return [int(p) for p in out if Path(f"/proc/{p}").exists() and not _zombie(int(p))]

    def signal_all(self, sig: signal.Signals) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def kill_all(self) -> None:
        """SIGKILL every process of this host (stopped ones too) and reap the test's own."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 30
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.1)


def _zombie(pid: int) -> bool:
    """Whether `pid` has exited and waits to be reaped (or is gone)."""
    try:
        return "zombie" in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
