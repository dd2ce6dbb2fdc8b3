"""A parameter-server job under `dtrain run -n W --servers S`: who is who, and where.

The launcher starts W workers and S servers per machine (dtrain.launch.roles) and gives
every process the job's shared secret. Worker 0 publishes its model's parameter count and
its settings' `copies` in the job's rendezvous store (the launcher's role processes read
the latter to tell a server's death the job survives from one it does not: `copies`);
each server waits for the count (its sockets refuse frames larger than
its shard), binds a free port, publishes its address in the same store, and serves
(`serve_from_env`: no user code); a worker's `ps.Worker` reads the addresses from the
store (`server_addresses`). A server started in a dead one's place (`join`) reads the dead
one's address there, publishes its own in its stead, and joins the chains of its slot
(dtrain.ps.joining).
"""

from __future__ import annotations

import logging
import os
import secrets

import torch.distributed as dist

from dtrain import env
from dtrain.errors import ConfigError, DtrainError
from dtrain.store import connect


def new_secret() -> str:
    """A fresh random key for one job (hex)."""
    return secrets.token_hex(32)


def _need(var: env.Var | str) -> str:
    """The value of `var` (a contract variable, or torch's MASTER_ADDR or MASTER_PORT).

    Raises:
        DtrainError: it is not set (the process was not started by `dtrain run --servers`).
    """
    name = var if isinstance(var, str) else var.name
    value = os.environ.get(name) or None
    if value is None:
        raise DtrainError(f"{name} is not set: start parameter-server jobs with `dtrain run "
                          "--servers S`, or pass servers, rank and secret to ps.Worker")
    return value


def secret() -> bytes:
    """The job's shared key."""
    try:
        return bytes.fromhex(_need(env.PS_SECRET))
    except ValueError:
        raise ConfigError(f"{env.PS_SECRET.name} must be hex (for example from `openssl rand "
                          "-hex 32`)") from None


def worker_index() -> int:
    """This worker's index among the job's workers."""
    return int(_need(env.PS_INDEX))


def _store(timeout_s: float) -> dist.Store:
    """The job's store (node 0's, or the etcd cluster: dtrain.store)."""
    if env.RDZV_BACKEND.get() == "c10d":  # outside a job: says which variable is missing
        _need("MASTER_ADDR")
        _need("MASTER_PORT")
    return connect(timeout_s)


def _key(name: str) -> str:
    # A restart of the job gets fresh keys: its servers bind new ports.
    return f"dtrain/ps/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"


def _addresses(store, n: int, timeout_s: float) -> list[str]:
    try:
        store.wait([_key(f"server/{i}") for i in range(n)])
    except RuntimeError:
        raise DtrainError(f"the {n} parameter server(s) did not all start within "
                          f"{timeout_s:.0f}s; see their output above") from None
    return [store.get(_key(f"server/{i}")).decode() for i in range(n)]


def server_addresses(numel: int, publish: bool, copies: int = 1,
                     timeout_s: float = 120.0) -> list[str]:
    """The job's server addresses in shard order, once every server has published its own;
    with `publish` (worker 0), first the settings' `copies` and the model's parameter
    count `numel`, which the servers wait for.

    Raises:
        DtrainError: not a parameter-server job, or a server did not come up in time.
    """
    n = int(_need(env.PS_SERVERS))
    store = _store(timeout_s)
    if publish:
        store.set(_key("copies"), str(copies))
        store.set(_key("numel"), str(numel))
    return _addresses(store, n, timeout_s)


def serve_from_env(start_timeout_s: float = 600.0, join: bool = False) -> None:
    """Run this process as server INDEX of the job until every worker is done; with
    `join`, in the place of the server INDEX that died (if that one had published its
    address; else as it would have started).

    Raises:
        DtrainError: worker 0 did not publish its model's size within `start_timeout_s`
            (building a large model is slow), or the other servers did not come up.
    """
    from dtrain.ps.server import Server

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    index, n = int(_need(env.PS_INDEX)), int(_need(env.PS_SERVERS))
    host = env.PS_HOST.get() or "127.0.0.1"
    store = _store(start_timeout_s)
    try:
        store.wait([_key("numel")])
    except RuntimeError:
        raise DtrainError(f"parameter server {index}: worker 0 did not publish its model's "
                          f"size within {start_timeout_s:.0f}s; see its output above") from None
    slot = _key(f"server/{index}")
    replaced = store.get(slot).decode() if join and store.check([slot]) else None
    server = Server(int(_need(env.PS_WORKERS)), secret(), int(store.get(_key("numel"))),
                    index=index, servers=n, bind=f"tcp://{host}:0",
                    snapshot_dir=env.PS_SNAPSHOT_DIR.get(),
                    snapshot_every=env.PS_SNAPSHOT_EVERY.get(), join=replaced is not None)
    store.set(slot, server.address)
    peers = _addresses(store, n, start_timeout_s)
    if replaced is not None:
        peers[index] = replaced
    server.set_peers(peers)
    finished = [_key(f"finished/{i}") for i in range(n)]

    def job_over() -> bool:
        """A server finishes once every worker is done: a new one that could not join by
        then has nothing left to do (nor when the store is gone with the job)."""
        try:
            return any(store.check([key]) for key in finished)
        except RuntimeError:
            return True

    server.serve(job_over=job_over)
    store.set(_key(f"finished/{index}"), "1")


def copies(timeout_s: float = 30.0) -> int:
    """The copies of each shard worker 0's settings asked for (1 if it published none: a
    server that died before the job started is not survivable)."""
    store = _store(timeout_s)
    if not store.check([_key("copies")]):
        return 1
    return int(store.get(_key("copies")))
