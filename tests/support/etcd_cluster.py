"""A real etcd cluster of three members on loopback ports, for the tests of the etcd store
and of a job that survives losing any host (Debian's `etcd-server`; tests skip, saying why,
where it is not installed).

Elections are quick (heartbeat 50 ms, election timeout 500 ms) so that losing the leader
costs the job well under a second; the defaults (100 ms, 1 s) are what a real cluster uses.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.tools import missing


def etcd_binary() -> str:
    found = shutil.which("etcd")
    if found is None:
        missing("etcd is not installed (Debian: apt install etcd-server; make "
                    "install-launchers installs it)")
    try:
        import etcd  # noqa: F401
    except ImportError:
        missing("python-etcd is not installed (pip install 'dtrain[etcd]')")
    return found


LISTEN_PORTS = range(20000, 32000)
"""Where the members' ports are drawn: below Linux's ephemeral range (32768-60999 by
default), so that no connection's local port takes one between the draw and etcd's bind
(a port the OS picked with bind(0) and then freed could go to the next connect())."""


def _free_ports(count: int, host: str) -> list[int]:
    """`count` ports of LISTEN_PORTS free on `host` now."""
    found: list[int] = []
    for port in random.sample(LISTEN_PORTS, len(LISTEN_PORTS)):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        found.append(port)
        if len(found) == count:
            return found
    raise RuntimeError(f"no {count} free ports in {LISTEN_PORTS} on {host}")


@dataclass
class Member:
    name: str
    client_url: str
    peer_url: str
    data_dir: Path
    log: Path
    process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return self.client_url.removeprefix("http://")


@dataclass
class EtcdCluster:
    """Three members; `hosts[i]` is the address member i listens on (loopback, or a network
    namespace's address when `netns[i]` names one)."""

    folder: Path
    hosts: list[str]
    netns: list[str | None] = field(default_factory=list)
    members: list[Member] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.netns = self.netns or [None] * len(self.hosts)
        for i, host in enumerate(self.hosts):
            client, peer = _free_ports(2, "127.0.0.1")
            self.members.append(Member(f"m{i}", f"http://{host}:{client}",
                                       f"http://{host}:{peer}", self.folder / f"m{i}",
                                       self.folder / f"m{i}.log"))

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def start(self, i: int, state: str = "new") -> None:
        m = self.members[i]
        initial = ",".join(f"{x.name}={x.peer_url}" for x in self.members)
        command = [etcd_binary(), "--name", m.name, "--data-dir", str(m.data_dir),
                   "--listen-client-urls", m.client_url, "--advertise-client-urls", m.client_url,
                   "--listen-peer-urls", m.peer_url, "--initial-advertise-peer-urls", m.peer_url,
                   "--initial-cluster", initial, "--initial-cluster-state", state,
                   "--initial-cluster-token", self.folder.name,
                   "--heartbeat-interval", "50", "--election-timeout", "500",
                   "--enable-v2=true", "--logger", "zap", "--log-level", "error"]
        if self.netns[i]:
            command = ["ip", "netns", "exec", self.netns[i], *command]
        m.process = subprocess.Popen(command, stdout=m.log.open("ab"), stderr=subprocess.STDOUT)

    def start_all(self) -> None:
        for i in range(len(self.members)):
            self.start(i)
        self.wait_healthy()

    def wait_healthy(self, timeout: float = 30) -> None:
        import etcd

        deadline = time.monotonic() + timeout
        while True:
            try:
                alive = [m for m in self.members if m.process and m.process.poll() is None]
                for m in alive:
                    host, port = m.endpoint.rsplit(":", 1)
                    etcd.Client(host=host, port=int(port), read_timeout=1).read(
                        "/", quorum=True)
                return
            except Exception as exc:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline:
                    logs = "\n".join(m.log.read_text()[-2000:] for m in self.members
                                     if m.log.exists())
                    raise RuntimeError(f"etcd cluster not healthy in {timeout}s:\n{logs}") \
                        from exc
                time.sleep(0.1)

    def leader(self) -> int:
        """The index of the member that leads now."""
        import etcd

        for m in self.members:
            if m.process is None or m.process.poll() is not None:
                continue
            host, port = m.endpoint.rsplit(":", 1)
            try:
                name = etcd.Client(host=host, port=int(port), read_timeout=1).leader["name"]
                return int(name.removeprefix("m"))
            except Exception:  # noqa: BLE001 - this member cannot say: ask another
                continue
        raise RuntimeError("no member names a leader")

    def kill(self, i: int) -> None:
        m = self.members[i]
        if m.process is not None and m.process.poll() is None:
            m.process.kill()
            m.process.wait()

    def restart(self, i: int) -> None:
        """Member i again, with the data it had (it catches up from the others)."""
        self.kill(i)
        self.start(i, state="existing")

    def stop(self) -> None:
        for i in range(len(self.members)):
            self.kill(i)
