"""Hosts joined by slow links on one Linux machine, for tests and benchmarks: each host a
network namespace, the link between any two a bandwidth and a one-way delay.

    with EmulatedHosts(hosts=2, rate_mbit=100, delay_ms=20) as net:  # or .over(FAST_WAN)
        jobs = [net.popen(h, ["dtrain", "run", "--nnodes", "2", "--node-rank", str(h), "-n",
                              "2", "--master", f"{net.address(0)}:29500", "train.py"])
                for h in range(2)]  # GLOO_SOCKET_IFNAME and MASTER_ADDR set: net.env(h)

The kernel this was built on has no netem (nor fq or prio), so a link is made of:

- bandwidth: a `tbf` qdisc shapes what each host sends. A packet is at most about a
  millisecond of the link (the MTU: the bytes of PACKET_SECONDS, within 1500 .. 65000),
  small beside the delay, yet at 1 Gbit/s big enough (64 KB) for a Python delay line.
  The bucket holds two packets (tbf must fit a whole one; a bigger one lets bursts out
  above the rate); the queue one round trip of the link (at least four packets): the
  classic router buffer, which one TCP flow fills, adding at most a round trip.
- delay: each host's device is a TUN device whose other end is a delay line in user space
  (`python -m dtrain.tools.emulated_links forward`, started here): it reads the IPv4
  packets every host sends and writes each to its destination's device `delay` later.
  The delay being constant, one first-in first-out queue keeps every flow in order; the
  line wakes at each packet's due time, so the delay is exact to the scheduler's jitter.

The hosts form a star, shaped as they send, not as they receive: a host several send to
at once can receive faster than `rate`. Host h is SUBNET.(h+1)/24 on device `{prefix}t{h}`
in namespace `{prefix}h{h}`; the machine's own namespace gets no address, so nothing
clashes with its routes.

Leaving the `with` block, by an exception too, removes it all. If its owner is killed,
the delay line ends (its standard input does) and its TUN devices with it; `sweep(prefix)`
deletes the namespaces left. Needs root, `ip`, `tc`, /dev/net/tun and the tbf qdisc.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import ipaddress
import os
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dtrain.errors import DtrainError, exit_code_of

DEFAULT_PREFIX = "dtel"
DEFAULT_SUBNET = "10.177.0"  # first three octets; seen only inside the hosts' namespaces
PACKET_SECONDS = 1e-3  # a packet's time on the wire, at most (see the module doc)
MIN_MTU = 1500  # Ethernet's, for links too slow to send that much in PACKET_SECONDS
MAX_MTU = 65000  # below the 65535 bytes of the largest IPv4 packet
READ_BYTES = 1 << 16  # more than the largest packet
TUNSETIFF = 0x400454CA  # linux/if_tun.h
IFF_TUN = 0x0001  # IP packets (not Ethernet frames)
IFF_NO_PI = 0x1000  # without the 4-byte packet-info header
COMMAND_TIMEOUT_S = 30  # an `ip` or `tc` command's limit
STOP_TIMEOUT_S = 10  # how long a process killed or told to stop is waited for


@dataclass(frozen=True)
class Link:
    """A link's bandwidth in each direction (Mbit/s, 10^6 bits) and one-way delay (ms).

    Raises:
        DtrainError: the rate is not above 0, or the delay is negative.
    """

    rate_mbit: float
    delay_ms: float

    def __post_init__(self) -> None:
        if not self.rate_mbit > 0:
            raise DtrainError(f"rate_mbit={self.rate_mbit}: a link's rate must be above 0")
        if not self.delay_ms >= 0:
            raise DtrainError(f"delay_ms={self.delay_ms}: a link's delay cannot be negative")

    @property
    def bytes_per_second(self) -> float:
        """The rate in bytes per second."""
        return self.rate_mbit * 1e6 / 8

    @property
    def mtu(self) -> int:
        """The hosts' device MTU: the bytes of PACKET_SECONDS on the link, within bounds."""
        return int(min(MAX_MTU, max(MIN_MTU, self.bytes_per_second * PACKET_SECONDS)))

    def tbf(self) -> list[str]:
        """tc's arguments for the qdisc shaping a host's sending (the module doc says why)."""
        round_trip_bytes = self.bytes_per_second * 2 * self.delay_ms / 1e3
        return ["tbf", "rate", f"{round(self.rate_mbit * 1e6)}bit", "burst", str(2 * self.mtu),
                "limit", str(int(max(4 * self.mtu, round_trip_bytes)))]


GIGABIT_LAN = Link(rate_mbit=1000, delay_ms=1)
FAST_WAN = Link(rate_mbit=100, delay_ms=20)
SLOW_WAN = Link(rate_mbit=10, delay_ms=50)


def check_environment() -> None:
    """Raises DtrainError naming what emulated hosts need and this machine lacks."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (to make network namespaces)")
    missing += [f"`{tool}` (iproute2)" for tool in ("ip", "tc") if shutil.which(tool) is None]
    if not os.path.exists("/dev/net/tun"):
        missing.append("/dev/net/tun (the tun module)")
    if missing:
        raise DtrainError(f"emulated hosts need {', '.join(missing)}")


def _check_prefix(prefix: str) -> None:
    """Device names stay within Linux's 15 characters, and plain."""
    if not re.fullmatch(r"[a-z][a-z0-9]{0,9}", prefix):
        raise DtrainError(f"prefix {prefix!r}: use 1 to 10 lower-case letters and digits, "
                          "starting with a letter")


def _command(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if check and result.returncode != 0:
        why = result.stderr.strip().replace("\n", "; ") or f"exit code {result.returncode}"
        raise DtrainError(f"`{' '.join(argv)}` failed: {why}")
    return result


def _namespaces(prefix: str) -> list[str]:
    names = (line.split()[0] for line in _command("ip", "netns", "list").stdout.splitlines()
             if line.strip())
    return [n for n in names if re.fullmatch(rf"{prefix}h\d+", n)]


def _kill_namespace(namespace: str) -> None:
    """SIGKILL every process in `namespace`; wait (a while) until none is left, since the
    namespace and its devices live on as long as one does."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline:
        pids = _command("ip", "netns", "pids", namespace, check=False).stdout.split()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.05)


def sweep(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Delete the namespaces emulated hosts of `prefix` left behind (after a crash or a
    kill), every process in them killed first; returns their names. (A TUN device not yet
    moved into its namespace vanishes with its owner.)

    Raises:
        DtrainError: a malformed prefix, or `ip` failed.
    """
    _check_prefix(prefix)
    removed = []
    for namespace in _namespaces(prefix):
        _kill_namespace(namespace)
        _command("ip", "netns", "del", namespace)
        removed.append(namespace)
    return removed


def open_tun(name: str) -> int:
    """A file descriptor of a new TUN device `name` (IP packets, no header before them);
    the device lasts as long as a descriptor of it stays open."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError as exc:
        os.close(fd)
        raise DtrainError(f"cannot make TUN device {name}: {exc.strerror}") from None
    return fd


class EmulatedHosts:
    """`hosts` network namespaces standing for machines, each pair joined by a link of
    `rate_mbit` Mbit/s and `delay_ms` ms one way: made on entering the `with` block,
    removed on leaving it, however it is left.

    `prefix` names the namespaces (`{prefix}h{h}`) and devices (`{prefix}t{h}`): hosts
    alive at once need different ones. `subnet`: the addresses' first three octets.

    Raises:
        DtrainError: a bad argument (here), or on entering, a machine that cannot make
            the hosts (see check_environment) or a command that failed.
    """

    def __init__(self, hosts: int = 2, rate_mbit: float = FAST_WAN.rate_mbit,
                 delay_ms: float = FAST_WAN.delay_ms, *, prefix: str = DEFAULT_PREFIX,
                 subnet: str = DEFAULT_SUBNET) -> None:
        if not 2 <= hosts <= 253:
            raise DtrainError(f"hosts={hosts}: emulate between 2 and 253 hosts")
        self.link = Link(rate_mbit, delay_ms)
        _check_prefix(prefix)
        try:
            ipaddress.IPv4Network(f"{subnet}.0/24")
        except ValueError:
            raise DtrainError(f"subnet {subnet!r}: give three octets, e.g. 10.177.0") from None
        self.hosts = hosts
        self.prefix = prefix
        self.subnet = subnet
        self._procs: list[subprocess.Popen] = []
        self._forwarder: subprocess.Popen | None = None

    @classmethod
    def over(cls, link: Link, hosts: int = 2, **kwargs: str) -> EmulatedHosts:
        """Hosts joined by `link` (GIGABIT_LAN, FAST_WAN, SLOW_WAN or another)."""
        return cls(hosts, link.rate_mbit, link.delay_ms, **kwargs)

    def namespace(self, host: int) -> str:
        """The network namespace of `host` (for `ip netns exec`)."""
        return f"{self.prefix}h{self._checked(host)}"

    def interface(self, host: int) -> str:
        """The device of `host` (GLOO_SOCKET_IFNAME for processes on it)."""
        return f"{self.prefix}t{self._checked(host)}"

    def address(self, host: int) -> str:
        """The IPv4 address of `host`."""
        return f"{self.subnet}.{self._checked(host) + 1}"

    def env(self, host: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """`base` (default: this process's environment) for a process on `host`: gloo on
        the host's device (it would take the hostname's address, 127.0.0.1), host 0 the
        master."""
        return {**(os.environ if base is None else base),
                "GLOO_SOCKET_IFNAME": self.interface(host), "MASTER_ADDR": self.address(0)}

    def popen(self, host: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        """Start `argv` on `host` (`ip netns exec`) in a session of its own, with `env`
        (default: `self.env(host)`); `kwargs` go to subprocess.Popen. Leaving the hosts
        kills its process group if it still runs."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(host), *argv],
                                env=self.env(host) if env is None else env,
                                start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def __enter__(self) -> EmulatedHosts:
        check_environment()
        sweep(self.prefix)
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill what runs on the hosts, stop the delay line, delete the namespaces (and so
        their devices and qdiscs). Calling it again does nothing more."""
        for proc in self._procs:
            _kill_group(proc)
        self._procs.clear()
        if self._forwarder is not None:
            _stop(self._forwarder)
            self._forwarder = None
        sweep(self.prefix)

    def _checked(self, host: int) -> int:
        if not 0 <= host < self.hosts:
            raise DtrainError(f"host {host}: these emulated hosts are 0 to {self.hosts - 1}")
        return host

    def _start(self) -> None:
        fds: list[int] = []
        try:
            for host in range(self.hosts):
                fds.append(self._make_host(host))
            self._forwarder = _start_forwarder(fds, self.subnet, self.link.delay_ms)
        finally:
            for fd in fds:  # the delay line holds its own copies
                os.close(fd)

    def _make_host(self, host: int) -> int:
        """Host `host`'s namespace and shaped device; returns the device's descriptor."""
        namespace = self.namespace(host)
        device = self.interface(host)
        inside = ("ip", "-n", namespace)
        _command("ip", "netns", "add", namespace)
        fd = open_tun(device)
        try:
            for argv in (("ip", "link", "set", device, "netns", namespace),  # fd stays attached
                         (*inside, "addr", "add", f"{self.address(host)}/24", "dev", device),
                         (*inside, "link", "set", device, "mtu", str(self.link.mtu), "up"),
                         (*inside, "link", "set", "lo", "up"),
                         ("tc", "-n", namespace, "qdisc", "add", "dev", device, "root",
                          *self.link.tbf())):
                _command(*argv)
        except BaseException:
            os.close(fd)
            raise
        return fd


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):  # stuck: sweep waits for it
        proc.wait(timeout=STOP_TIMEOUT_S)


def _start_forwarder(fds: list[int], subnet: str, delay_ms: float) -> subprocess.Popen:
    """The delay line between the TUN devices `fds` (host h's at index h), once ready.
    In a session of its own, so that a Ctrl-C stops the caller, which then stops it."""
    argv = [sys.executable, "-m", "dtrain.tools.emulated_links", "forward",
            "--subnet", subnet, "--delay-ms", repr(delay_ms), *map(str, fds)]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, pass_fds=fds, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        _, err = proc.communicate(timeout=STOP_TIMEOUT_S)
        last = err.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        raise DtrainError(f"the delay line did not start: {last[0]}")
    return proc


def _stop(proc: subprocess.Popen) -> None:
    """End the delay line: its standard input closes, so it returns; killed if it hangs."""
    try:
        proc.communicate(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def forward(tuns: Sequence[int], subnet: str, delay_s: float, control: int = 0) -> None:
    """Pass IPv4 packets between the TUN devices `tuns` (host h's at index h, address
    `{subnet}.{h + 1}`), each `delay_s` after it arrives, until `control` ends (the hosts'
    owner closed it or died); others are dropped.

    Raises:
        OSError: a device failed or vanished (its namespace was deleted).
    """
    route = {ipaddress.IPv4Address(f"{subnet}.{h + 1}").packed: fd for h, fd in enumerate(tuns)}
    for fd in tuns:
        os.set_blocking(fd, False)
    line: deque[tuple[float, int, bytes]] = deque()  # (due time, destination, packet)
    while True:
        wait = max(0.0, line[0][0] - time.monotonic()) if line else None
        readable, _, _ = select.select([control, *tuns], [], [], wait)
        if control in readable and not os.read(control, 4096):
            return
        for fd in set(readable) - {control}:
            _receive(fd, route, delay_s, line)
        _deliver(line)


def _receive(fd: int, route: dict[bytes, int], delay_s: float,
             line: deque[tuple[float, int, bytes]]) -> None:
    """Queue every packet waiting on `fd` (IPv4: destination in bytes 16-20)."""
    while True:
        try:
            packet = os.read(fd, READ_BYTES)
        except BlockingIOError:
            return
        target = route.get(packet[16:20]) if packet[:1] and packet[0] >> 4 == 4 else None
        if target is not None:
            line.append((time.monotonic() + delay_s, target, packet))


def _deliver(line: deque[tuple[float, int, bytes]]) -> None:
    now = time.monotonic()
    while line and line[0][0] <= now:
        _, fd, packet = line.popleft()
        os.write(fd, packet)


def _forward_command(args: argparse.Namespace) -> None:
    print("ready", flush=True)
    try:
        forward(args.fds, args.subnet, args.delay_ms / 1e3)
    except OSError as exc:
        raise DtrainError(f"delay line stopped: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    """`python -m dtrain.tools.emulated_links forward|sweep ...`."""
    parser = argparse.ArgumentParser(prog="python -m dtrain.tools.emulated_links")
    commands = parser.add_subparsers(required=True)
    line = commands.add_parser("forward", help="the delay line EmulatedHosts starts")
    line.add_argument("--subnet", default=DEFAULT_SUBNET)
    line.add_argument("--delay-ms", type=float, required=True)
    line.add_argument("fds", type=int, nargs="+", help="TUN devices' descriptors, by host")
    line.set_defaults(run=_forward_command)
    leftovers = commands.add_parser("sweep", help="delete hosts a crashed run left behind")
    leftovers.add_argument("--prefix", default=DEFAULT_PREFIX)
    leftovers.set_defaults(run=lambda args: print(*sweep(args.prefix), sep="\n"))
    args = parser.parse_args(argv)
    return exit_code_of(lambda: args.run(args))


if __name__ == "__main__":
    sys.exit(main())
