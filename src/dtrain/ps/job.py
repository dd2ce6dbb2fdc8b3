"""A parameter-server job under `dtrain run -n W --servers S`: who is who, and where.

The launcher starts W workers and S servers per machine (dtrain.launch.roles) and gives
every process the job's shared secret. A server binds a free port, publishes its address
in the job's rendezvous store, and serves (`serve_from_env`: no user code); a worker's
`ps.Worker` reads the addresses from the same store (`server_addresses`).
"""

from __future__ import annotations

import logging
import os
import secrets
from datetime import timedelta

from dtrain.errors import ConfigError, DtrainError
from dtrain.ft import env


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


def _store(timeout_s: float):
    from torch.distributed import TCPStore

    host, port = _need("MASTER_ADDR"), int(_need("MASTER_PORT"))
    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def _key(index: int) -> str:
    # A restart of the job gets fresh keys: its servers bind new ports.
    return f"dtrain/ps/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/server/{index}"


def server_addresses(timeout_s: float = 120.0) -> list[str]:
    """The job's server addresses in shard order, once every server has published its own.

    Raises:
        DtrainError: not a parameter-server job, or a server did not come up in time.
    """
    n = int(_need(env.PS_SERVERS))
    store = _store(timeout_s)
    try:
        store.wait([_key(i) for i in range(n)])
    except RuntimeError:
        raise DtrainError(f"the {n} parameter server(s) did not all start within "
                          f"{timeout_s:.0f}s; see their output above") from None
    return [store.get(_key(i)).decode() for i in range(n)]


def serve_from_env() -> None:
    """Run this process as server INDEX of the job until every worker is done."""
    from dtrain.ps.server import Server

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    index = int(_need(env.PS_INDEX))
    host = env.PS_HOST.get() or "127.0.0.1"
    server = Server(int(_need(env.PS_WORKERS)), secret(), index=index, bind=f"tcp://{host}:0",
                    snapshot_dir=env.PS_SNAPSHOT_DIR.get(),
                    snapshot_every=env.PS_SNAPSHOT_EVERY.get())
    _store(120.0).set(_key(index), server.address)
    server.serve()
