"""Machines simulated on one: network namespaces, each standing for a host, and what a
test started in them (tests/launch/test_multihost.py, tests/ft/test_host_loss.py,
tests/ps/test_replacement.py). Needs root and iproute2's `ip`; the tests that make
namespaces skip, saying why, without them."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import forked
from tests.support.tools import missing


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


@contextlib.contextmanager
def bridged(hosts: list[Host], bridge: str, subnet: str) -> Iterator[list[Host]]:
    """`hosts`' namespaces, made and linked to a bridge of this machine named `bridge`,
    loopback up in each; the bridge has address `subnet`.254 on the hosts' subnet, so the
    test reaches the hosts as a client on their network would. Afterwards every process in
    them is killed and all of it removed. Skips the test (`missing`) where namespaces
    cannot be made."""
    if sys.platform != "linux" or shutil.which("ip") is None:
        missing("needs Linux and iproute2's `ip` to make network namespaces")
    made: list[str] = []
    ports = [f"{bridge}p{i}" for i in range(len(hosts))]
    try:
        for host in hosts:
            result = ip("netns", "add", host.ns, check=False)
            if result.returncode != 0:
                missing(f"cannot make network namespaces (`ip netns add` failed: "
                        f"{result.stderr.strip()}); run as root to simulate hosts")
            made.append(host.ns)
        ip("link", "add", bridge, "type", "bridge")
        ip("addr", "add", f"{subnet}.254/24", "dev", bridge)
        ip("link", "set", bridge, "up")
        for host, port in zip(hosts, ports, strict=True):
            ip("link", "add", host.ifname, "netns", host.ns, "type", "veth", "peer", "name", port)
            ip("link", "set", port, "master", bridge)
            ip("link", "set", port, "up")
            ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
            ip("-n", host.ns, "link", "set", host.ifname, "up")
            ip("-n", host.ns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for host, port in zip(hosts, ports, strict=True):
            host.kill_all()
            # at once: the kernel frees a deleted namespace's end of the pair a little later
            ip("link", "del", port, check=False)
        for ns in made:
            ip("netns", "del", ns, check=False)
        ip("link", "del", bridge, check=False)
