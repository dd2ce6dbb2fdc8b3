"""The job's store on an etcd cluster: `--rdzv-backend etcd --rdzv-endpoints h1:2379,...`.

By default a job's store (rendezvous rounds, the launchers' heartbeats, the ranks' bootstrap
keys, the live replicas' votes and groups) is a TCPStore served by node 0's launcher, the
one machine a job cannot lose. With etcd it lives in a cluster that a consensus protocol
(Raft) keeps on several machines: losing one member of three, the leader included, loses
no key, and the clients go on through another member.

Two pieces, both on the etcd client library torch's own etcd rendezvous uses (`python-etcd`,
etcd's v2 API: etcd 3.4 and 3.5 serve it with `--enable-v2`):

- `Cluster`: the endpoints as one client. A request that cannot reach its member (refused,
  or unanswered for `REQUEST_TIMEOUT_S`: the member is down, cut off, or waiting for a new
  leader) goes to the next, until `give_up_s` passes; then `StoreUnreachable` names every
  endpoint and the time waited. Torch's `EtcdRendezvousBackend` takes it as its client, so
  the launchers' rounds fail over too.
- `EtcdStore`: a `torch.distributed.Store` on it, for everything else, gloo's bootstrap of
  process groups included. Each key is one etcd key (its name base64 encoded under the
  job's prefix), read with a quorum read so no member answers from a stale copy; waits
  watch the key from the index of the last read, so a write between the read and the watch
  is not missed. torch's own `EtcdStore` reads the whole folder of keys for each `get` and
  has no `compare_set` or `delete_key`, which live replicas need.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist
import urllib3

from dtrain.errors import ConfigError, LaunchError

DEFAULT_PORT = 2379
REQUEST_TIMEOUT_S = 1.0  # one request's wait on one member before the next is tried
WATCH_SLICE_S = 5.0  # a watch is renewed this often, so a dead member is noticed

T = TypeVar("T")

# A Store written in Python lives as two halves: torch's C++ object, which process groups and
# PrefixStores hold, and this Python object, which answers its calls. Once the Python half
# is collected, every call fails ("Not implemented"), so each EtcdStore made is kept here
# for the life of the process (a few per job: one per connection and per live membership).
_ALIVE: list[EtcdStore] = []


class StoreUnreachable(LaunchError):
    """No member of the etcd cluster answered within the store's timeout."""


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    """`h1:2379,h2:2379,...` (a port may be left out: 2379) as (host, port) pairs.

    Raises:
        ConfigError: empty, or an endpoint is not HOST[:PORT].
    """
    endpoints = []
    for item in (part.strip() for part in text.split(",")):
        item = item.removeprefix("http://")
        host, sep, port = item.rpartition(":") if item.count(":") == 1 or "]" in item \
            else (item, "", "")
        if not sep:
            host, port = item, str(DEFAULT_PORT)
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--rdzv-endpoints {text!r}: {item!r} is not HOST:PORT (for "
                              "example 10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379)")
        endpoints.append((host, int(port)))
    return endpoints


def describe(endpoints: Sequence[tuple[str, int]]) -> str:
    return ",".join(f"{host}:{port}" for host, port in endpoints)


def _etcd():
    """The etcd client library, or one line saying how to install it."""
    try:
        import etcd
    except ImportError:
        raise ConfigError("the etcd store needs the etcd client library: pip install "
                          "'dtrain[etcd]' (python-etcd)") from None
    logging.getLogger("etcd").setLevel(logging.CRITICAL)  # each failover is not an error
    return etcd


class Cluster:
    """The etcd members at `endpoints` as one client (python-etcd's `Client` interface:
    read, write, delete, test_and_set), failing over to the next member on a request that
    cannot complete, for up to `give_up_s`."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], give_up_s: float) -> None:
        etcd = _etcd()
        self.endpoints, self.give_up_s = list(endpoints), give_up_s
        self._clients = [etcd.Client(host=host, port=port, protocol="http",
                                     read_timeout=REQUEST_TIMEOUT_S, allow_reconnect=False)
                         for host, port in self.endpoints]
        for client in self._clients:
            # urllib3 would try each request 3 more times on the same member, and report a
            # watch that timed out as a connection lost: once, and the next member after
            client.http = urllib3.PoolManager(num_pools=10, retries=False)
        self._at = 0
        self._lost, self._timed_out = etcd.EtcdConnectionFailed, etcd.EtcdWatchTimedOut

    def _call(self, request: Callable[[object], T]) -> T:
        start = time.monotonic()
        while True:
            for _ in range(len(self._clients)):
                try:
                    return request(self._clients[self._at])
                except self._timed_out:  # a watch that saw no change: not a lost member
                    raise
                except self._lost:
                    self._at = (self._at + 1) % len(self._clients)
            waited = time.monotonic() - start
            if waited >= self.give_up_s:
                raise StoreUnreachable(
                    f"no member of the etcd cluster at {describe(self.endpoints)} answered in "
                    f"{waited:.0f}s (each is down, cut off, or the cluster has lost its "
                    "quorum): check the members with etcdctl endpoint health")
            time.sleep(0.05)

    def read(self, key: str, **options: object):
        return self._call(lambda client: client.read(key, **options))

    def write(self, key: str, value: str, ttl: int | None = None, **options: object):
        return self._call(lambda client: client.write(key, value, ttl, **options))

    def delete(self, key: str, **options: object):
        return self._call(lambda client: client.delete(key, **options))

    def test_and_set(self, key: str, value: str, prev_value: str, ttl: int | None = None):
        return self._call(lambda client: client.test_and_set(key, value, prev_value, ttl))

    def watch(self, key: str, index: int, timeout: float):
        """The first change of `key` at or after `index`; None when `timeout` passes first."""
        etcd = _etcd()
        try:
            return self.read(key, wait=True, waitIndex=index, timeout=timeout)
        except etcd.EtcdWatchTimedOut:
            return None

    def check(self, within_s: float) -> None:
        """Wait up to `within_s` for a member to answer; one that does not, while another
        does, is named in a warning.

        Raises:
            ConfigError: no member answered, naming them and the time waited.
        """
        start = time.monotonic()
        while True:
            silent = [f"{host}:{port}" for host, port in self.endpoints
                      if not _answers(host, port)]
            if len(silent) < len(self.endpoints):
                break
            waited = time.monotonic() - start
            if waited >= within_s:
                raise ConfigError(f"no etcd endpoint answered in {waited:.0f}s: "
                                  f"{', '.join(silent)} (is etcd running there, with "
                                  "--enable-v2?)")
            time.sleep(0.5)
        if silent:
            print(f"dtrain: etcd endpoint(s) {', '.join(silent)} do not answer; going on "
                  "with the others", flush=True)


def _answers(host: str, port: int) -> bool:
    """Whether the member at host:port answers a quorum read within one request's time."""
    try:
        Cluster([(host, port)], 0).read("/", quorum=True)
    except (StoreUnreachable, _etcd().EtcdException):  # down, or without the v2 API
        return False
    return True


def _encode(value: str | bytes) -> str:
    raw = value.encode() if isinstance(value, str) else bytes(value)
    return base64.b64encode(raw).decode()


def _decode(text: str) -> bytes:
    return base64.b64decode(text)


class EtcdStore(dist.Store):
    """A torch.distributed Store kept in an etcd cluster, under `prefix`.

    torch's `PrefixStore` cannot clone a store written in Python, and live replicas clone
    theirs for each thread: `under(prefix)` is this store's own prefixed view, which clones
    (dtrain.store.prefixed picks it for an EtcdStore).

    Args:
        endpoints: the cluster's members, (host, port).
        folder: the etcd folder of this store's keys (a job's run id).
        timeout: how long `get` and `wait` wait for a key, and how long a request may fail
            over before the cluster counts as unreachable.
        prefix: put before every key (as a `PrefixStore` would).
    """

    def __init__(self, endpoints: Sequence[tuple[str, int]], folder: str,
                 timeout: timedelta, prefix: str = "") -> None:
        super().__init__()  # the pybind trampoline needs it
        self._etcd = _etcd()
        self._endpoints, self._prefix = list(endpoints), prefix
        self._cluster = Cluster(endpoints, max(timeout.total_seconds(), REQUEST_TIMEOUT_S))
        self._folder = "/" + folder.strip("/") + "/"
        self.set_timeout(timeout)
        _ALIVE.append(self)

    def under(self, prefix: str) -> EtcdStore:
        """This store with `prefix` put before every key."""
        return EtcdStore(self._endpoints, self._folder, self.timeout, self._prefix + prefix)

    def _path(self, key: str) -> str:
        whole = self._prefix + key
        return self._folder + base64.urlsafe_b64encode(whole.encode()).decode()

    def _read(self, key: str) -> tuple[bytes | None, int]:
        """`key`'s value (None when absent) and the cluster's index when read."""
        try:
            node = self._cluster.read(self._path(key), quorum=True)
        except self._etcd.EtcdKeyNotFound as missing:
            return None, int(missing.payload.get("index", 0))
        return _decode(node.value), int(node.modifiedIndex)

    def _wait_for(self, key: str, deadline: float) -> bytes | None:
        value, index = self._read(key)
        while value is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                changed = self._cluster.watch(self._path(key), index + 1,
                                              min(left, WATCH_SLICE_S))
            except self._etcd.EtcdEventIndexCleared:  # more than 1000 writes since: read again
                changed = None
            if changed is not None and changed.action in ("set", "create", "compareAndSwap"):
                return _decode(changed.value)
            value, index = self._read(key)
        return value

    def _deadline(self, timeout: timedelta | None = None) -> float:
        return time.monotonic() + (timeout or self.timeout).total_seconds()

    # --- torch.distributed.Store
    def set(self, key: str, value: str | bytes) -> None:
        self._cluster.write(self._path(key), _encode(value))

    def get(self, key: str) -> bytes:
        value = self._wait_for(key, self._deadline())
        if value is None:
            raise dist.DistStoreError(f"wait timeout after {self.timeout.total_seconds():g}s "
                                      f"for key {key!r} in the etcd store")
        return value

    def add(self, key: str, amount: int) -> int:
        if amount == 0:  # a read (heartbeats read every counter this way), not a write
            value, _ = self._read(key)
            return 0 if value is None else int(value)
        path = self._path(key)
        try:
            self._cluster.write(path, _encode(str(amount)), prevExist=False)
            return amount
        except self._etcd.EtcdAlreadyExist:
            pass
        while True:
            node = self._cluster.read(path, quorum=True)
            total = int(_decode(node.value)) + amount
            try:
                self._cluster.test_and_set(path, _encode(str(total)), node.value)
                return total
            except self._etcd.EtcdCompareFailed:
                continue

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        path = self._path(key)
        expected_raw = expected.encode() if isinstance(expected, str) else bytes(expected)
        desired_raw = desired.encode() if isinstance(desired, str) else bytes(desired)
        while True:
            current, _ = self._read(key)
            try:
                if current is None:
                    if expected_raw:
                        return expected_raw  # torch's stores answer the expected value here
                    self._cluster.write(path, _encode(desired_raw), prevExist=False)
                elif current == expected_raw:
                    self._cluster.test_and_set(path, _encode(desired_raw), _encode(current))
                else:
                    return current
                return desired_raw
            except (self._etcd.EtcdAlreadyExist, self._etcd.EtcdCompareFailed,
                    self._etcd.EtcdKeyNotFound):
                continue  # another client moved first: look again

    def delete_key(self, key: str) -> bool:
        try:
            self._cluster.delete(self._path(key))
        except self._etcd.EtcdKeyNotFound:
            return False
        return True

    def check(self, keys: list[str]) -> bool:
        return all(self._read(key)[0] is not None for key in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        deadline = self._deadline(timeout)
        for key in keys:
            if self._wait_for(key, deadline) is None:
                waited = (timeout or self.timeout).total_seconds()
                raise dist.DistStoreError(f"wait timeout after {waited:g}s for key {key!r} "
                                          "in the etcd store")

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def num_keys(self) -> int:
        """The keys in this store's folder (every prefix's, as torch's stores count)."""
        try:
            folder = self._cluster.read(self._folder.rstrip("/"), quorum=True)
        except self._etcd.EtcdKeyNotFound:
            return 0
        return sum(1 for node in folder.leaves if not node.dir)

    def clone(self) -> EtcdStore:
        return self.under("")
