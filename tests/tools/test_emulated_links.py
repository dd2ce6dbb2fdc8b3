"""Emulated hosts (dtrain.tools.emulated_links): a link has the rate and delay asked for,
nothing is left behind however the hosts end, and bad arguments are refused in one line.

Needs root, iproute2 and /dev/net/tun: skipped, with the reason, where they are missing.
The slow test runs `dtrain bench comm --calibrate` on 2 hosts x 2 ranks (make test-slow).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.errors import DtrainError
from dtrain.planner.traced.links import Links
from dtrain.tools.emulated_links import EmulatedHosts, Link, check_environment, sweep
from tests.support import forked
from tests.support.held import children
from tests.support.poll import until
from tests.support.tools import missing

PORT = 29400  # nothing else listens inside a fresh namespace
_count = itertools.count()

PEER = r"""
import json, socket, sys, time

mode, addr, port, pings, bulk = sys.argv[1], sys.argv[2], int(sys.argv[3]), *map(int, sys.argv[4:])

def exact(conn, n):
    got = 0
    while got < n:
        chunk = conn.recv(min(n - got, 1 << 20))
        assert chunk, "peer closed"
        got += len(chunk)

def connect():
    deadline = time.monotonic() + 20
    while True:
        try:
            return socket.create_connection((addr, port), timeout=30)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)

if mode == "serve":
    with socket.create_server((addr, port)) as server:
        conn, _ = server.accept()
else:
    conn = connect()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
if mode == "serve":
    for _ in range(pings):
        exact(conn, 1)
        conn.sendall(b"p")
    exact(conn, bulk)
    conn.sendall(b"k")
else:
    rtts = []
    for _ in range(pings):
        start = time.perf_counter()
        conn.sendall(b"p")
        exact(conn, 1)
        rtts.append(time.perf_counter() - start)
    start = time.perf_counter()
    conn.sendall(bytes(bulk))
    exact(conn, 1)
    print(json.dumps({"rtts": rtts, "seconds": time.perf_counter() - start}))
"""
"""A TCP peer: `serve` on host 1 echoes pings then takes the bulk; the client on host 0
times each ping's round trip and the bulk until the server's acknowledgement."""


@pytest.fixture
def prefix() -> str:
    """A prefix no other test (nor another run at once) uses; what it names is swept after."""
    try:
        check_environment()
    except DtrainError as exc:
        missing(str(exc))
    name = f"dt{os.getpid() % 10**6}{next(_count)}"
    yield name
    sweep(name)


def ours(prefix: str) -> list[str]:
    """Namespaces, devices and qdiscs of this machine that name `prefix`."""
    listings = (["ip", "netns", "list"], ["ip", "-o", "link", "show"], ["tc", "qdisc", "show"])
    return [line for argv in listings
            for line in subprocess.run(argv, capture_output=True, text=True).stdout.splitlines()
            if prefix in line]


def alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def ping_and_bulk(net: EmulatedHosts, pings: int, bulk: int) -> dict:
    """The client's measurements of PEER between host 0 and host 1."""
    args = [net.address(1), str(PORT), str(pings), str(bulk)]
    server = net.popen(1, [sys.executable, "-c", PEER, "serve", *args])
    client = net.popen(0, [sys.executable, "-c", PEER, "connect", *args],
                       stdout=subprocess.PIPE, text=True)
    out, _ = client.communicate(timeout=60)
    assert client.returncode == 0 and server.wait(timeout=10) == 0
    return json.loads(out)


@pytest.mark.timeout(60)
def test_a_link_has_its_delay_and_rate(prefix: str) -> None:
    link = Link(rate_mbit=20, delay_ms=10)
    with EmulatedHosts.over(link, prefix=prefix) as net:
        assert net.address(1).endswith(".2") and net.env(1)["MASTER_ADDR"] == net.address(0)
        measured = ping_and_bulk(net, pings=20, bulk=4 << 20)
    rtt_ms = sorted(measured["rtts"])[len(measured["rtts"]) // 2] * 1e3
    assert 2 * link.delay_ms <= rtt_ms < 2 * link.delay_ms + 10, measured["rtts"]
    mbit = (4 << 20) * 8 / measured["seconds"] / 1e6
    assert 0.75 * link.rate_mbit < mbit < 1.05 * link.rate_mbit, f"{mbit:.1f} Mbit/s"


@pytest.mark.timeout(60)
def test_nothing_is_left_after_an_exception(prefix: str) -> None:
    with pytest.raises(RuntimeError, match="the body failed"):
        with EmulatedHosts(hosts=3, rate_mbit=10, delay_ms=5, prefix=prefix) as net:
            sleeper = net.popen(2, ["sleep", "60"])
            assert len(ours(prefix)) == 3  # the namespaces (each holds its device and qdisc)
            raise RuntimeError("the body failed")
    assert sleeper.returncode is not None and ours(prefix) == []


CRASHING_OWNER = """
import sys, time
from dtrain.tools.emulated_links import EmulatedHosts
net = EmulatedHosts(hosts=2, rate_mbit=10, delay_ms=1, prefix=sys.argv[1]).__enter__()
net.popen(1, ["sleep", "60"])
print("up", flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_sweep_removes_what_a_killed_owner_left(prefix: str) -> None:
    owner = subprocess.Popen([sys.executable, "-c", CRASHING_OWNER, prefix],
                             stdout=subprocess.PIPE, text=True)
    assert owner.stdout.readline() == "up\n"
    started = children(owner.pid)  # the delay line and the sleep on host 1
    owner.send_signal(signal.SIGKILL)
    owner.wait(timeout=10)
    assert any(line.startswith(f"{prefix}h1") for line in ours(prefix))  # left behind
    assert sorted(sweep(prefix)) == [f"{prefix}h0", f"{prefix}h1"]
    assert ours(prefix) == [] and len(started) == 2
    # the delay line ends once it sees its owner gone
    until(lambda: not any(map(alive, started)), 10, "end of the delay lines", every=0.05)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"hosts": 1}, "hosts=1: emulate between 2 and 253 hosts"),
    ({"rate_mbit": 0}, "rate_mbit=0: a link's rate must be above 0"),
    ({"rate_mbit": -5}, "rate_mbit=-5: a link's rate must be above 0"),
    ({"delay_ms": -1}, "delay_ms=-1: a link's delay cannot be negative"),
    ({"prefix": "Bad-Name"}, "prefix 'Bad-Name': use 1 to 10 lower-case letters"),
    ({"subnet": "10.1"}, "subnet '10.1': give three octets"),
])
def test_bad_arguments_are_refused_in_one_line(kwargs: dict, message: str) -> None:
    with pytest.raises(DtrainError) as caught:
        EmulatedHosts(**kwargs)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


@pytest.mark.timeout(10)
def test_packets_are_about_a_millisecond_of_the_link() -> None:
    assert Link(10, 50).mtu == 1500 and Link(100, 20).mtu == 12500
    assert Link(1000, 1).mtu == 65000
    # burst: two packets; queue: one round trip of the link (20 Mbit/s x 20 ms = 50 KB)
    assert Link(20, 10).tbf() == ["tbf", "rate", "20000000bit", "burst", "5000",
                                  "limit", "50000"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_calibration_measures_the_emulated_link(prefix: str, tmp_path: Path) -> None:
    """2 hosts x 2 ranks calibrate dtrain.comm's all-reduce (the backend's own algorithm:
    `--ops` and `--algorithms` choose what --calibrate times) across a 500 Mbit/s, 5 ms
    link: the fitted latency and bandwidth are the link's, within a generous factor, and
    `dtrain plan` reads them like any other links."""
    link = Link(rate_mbit=500, delay_ms=5)
    calibration = tmp_path / "calibration.json"
    with EmulatedHosts.over(link, prefix=prefix) as net:
        # each host's launcher forked into its namespace (tests.support.forked: no import
        # of torch to wait for); after the calibration the table times one size, 4 KiB
        jobs = [forked.start(
            ["run", "--nnodes", "2", "--node-rank", str(host), "--master",
             f"{net.address(0)}:{PORT}", "--join-timeout", "60", "-n", "2",
             "-m", "dtrain.tools.comm_bench", "--calibrate", "--ops", "all_reduce",
             "--algorithms", "native", "--min-bytes", "4K", "--max-bytes", "4K"],
            env=net.env(host, {**os.environ, "OMP_NUM_THREADS": "1",
                               "DTRAIN_CALIBRATION": str(calibration)}),
            out=tmp_path / f"host{host}.log", netns=net.namespace(host)) for host in range(2)]
        codes = [job.wait(timeout=500) for job in jobs]
    logs = "".join((tmp_path / f"host{h}.log").read_text() for h in range(2))
    assert codes == [0, 0], logs
    links = Links.calibrated(str(calibration))
    assert links is not None, calibration.read_text()
    alpha, beta = links.per_op["all_reduce"]
    assert link.delay_ms / 1e3 <= alpha < 20 * link.delay_ms / 1e3, (alpha, logs)
    assert link.bytes_per_second / 2 < 1 / beta < 1.5 * link.bytes_per_second, (beta, logs)
    planned = subprocess.run([sys.executable, "-m", "dtrain.cli", "plan", "-n", "4"],
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "DTRAIN_CALIBRATION": str(calibration)})
    assert f"links: measured: {calibration}" in planned.stdout, planned.stdout + planned.stderr
    assert "synchronizing dp" in planned.stdout, planned.stdout
