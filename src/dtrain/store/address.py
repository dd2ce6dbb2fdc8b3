"""The job's store, as every part of a job reaches it.

A job keeps its shared state in one key-value store: the launchers' rendezvous rounds and
heartbeats, the ranks' bootstrap keys, the live replicas' votes and groups, the parameter
servers' addresses. Where it lives is the launcher's choice (`--rdzv-backend`), handed to
every process it starts in DTRAIN_RDZV_BACKEND:

- `c10d` (the default): a TCPStore served by node 0's launcher at MASTER_ADDR:MASTER_PORT.
  Nothing to install, and the job cannot lose node 0.
- `etcd`: an etcd cluster at DTRAIN_RDZV_ENDPOINTS (dtrain.store.etcd), which survives losing
  any one of three members; the keys of a job live under its run id.

`connect()` opens a client of it, whichever it is; `prefixed()` is a view of a store under
a prefix that can still be cloned (torch's PrefixStore cannot clone a store written in
Python, as the etcd store is).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from dtrain import env
from dtrain.errors import ConfigError

BACKENDS = ("c10d", "etcd")


@dataclass(frozen=True)
class StoreAddress:
    """Where a job's store is: `backend` c10d at (host, port), or etcd at `endpoints` with the
    job's keys under `run_id`."""

    backend: str
    host: str = ""
    port: int = 0
    endpoints: tuple[tuple[str, int], ...] = ()
    run_id: str = ""

    @classmethod
    def from_env(cls) -> StoreAddress:
        """The job's store as the launcher told this process (DTRAIN_RDZV_BACKEND and
        DTRAIN_RDZV_ENDPOINTS, or MASTER_ADDR and MASTER_PORT)."""
        backend = env.RDZV_BACKEND.get()
        if backend == "etcd":
            from dtrain.store.etcd import parse_endpoints

            return cls("etcd", endpoints=tuple(parse_endpoints(env.RDZV_ENDPOINTS.get())),
                       run_id=env.RUN_ID.get() or "")
        return cls("c10d", os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))

    def env(self) -> dict[str, str]:
        """The variables that tell a process started by the launcher where the store is
        (MASTER_ADDR/PORT come from torch's agent)."""
        if self.backend != "etcd":
            return env.RDZV_BACKEND.pair("c10d")
        from dtrain.store.etcd import describe

        return {**env.RDZV_BACKEND.pair("etcd"),
                **env.RDZV_ENDPOINTS.pair(describe(self.endpoints))}

    def first(self) -> tuple[str, int]:
        """An address the store answers at: the master, or the cluster's first member (the
        route to it says which of this machine's addresses the job sees)."""
        return self.endpoints[0] if self.backend == "etcd" else (self.host, self.port)

    def describe(self) -> str:
        if self.backend == "etcd":
            from dtrain.store.etcd import describe

            return f"the etcd cluster at {describe(self.endpoints)}"
        return f"the store at {self.host}:{self.port}"

    def connect(self, timeout_s: float) -> dist.Store:
        """A client of the store; each `get` and `wait` waits up to `timeout_s`."""
        timeout = timedelta(seconds=timeout_s)
        if self.backend == "etcd":
            from dtrain.store.etcd import EtcdStore

            return EtcdStore(self.endpoints, f"dtrain/{self.run_id}", timeout)
        return dist.TCPStore(self.host, self.port, is_master=False, timeout=timeout)


def connect(timeout_s: float = 60.0) -> dist.Store:
    """A client of this job's store (where the launcher's variables say: StoreAddress)."""
    return StoreAddress.from_env().connect(timeout_s)


def prefixed(prefix: str, store: dist.Store) -> dist.Store:
    """`store` with `prefix` put before every key; `clone()` works on the result."""
    from dtrain.store.etcd import EtcdStore

    if isinstance(store, EtcdStore):
        return store.under(prefix)
    return dist.PrefixStore(prefix, store)


def check_backend(backend: str, endpoints: str, run_id: str | None) -> None:
    """Refuse an unknown backend, etcd without endpoints or run id, and endpoints without etcd.

    Raises:
        ConfigError: what to fix, in one line.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"--rdzv-backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if backend != "etcd":
        if endpoints:
            raise ConfigError("--rdzv-endpoints is for --rdzv-backend etcd (the c10d store is "
                              "node 0's, at --master)")
        return
    from dtrain.store.etcd import parse_endpoints

    if not endpoints:
        raise ConfigError("--rdzv-backend etcd needs --rdzv-endpoints HOST:PORT,... (the etcd "
                          "cluster's members, three for a cluster that survives losing one)")
    parse_endpoints(endpoints)
    if not run_id:
        raise ConfigError("--rdzv-backend etcd needs --rdzv-id NAME: the same on every machine "
                          "of the job and new for each job (the etcd cluster outlives it; a "
                          "scheduler's job id will do)")
