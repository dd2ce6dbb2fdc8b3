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

SERVERS = "DTRAIN_PS_SERVERS"  # servers in the whole job
WORKERS = "DTRAIN_PS_WORKERS"  # workers in the whole job
INDEX = "DTRAIN_PS_INDEX"  # this process's index among the servers or the workers
SECRET = "DTRAIN_PS_SECRET"  # hex; the same on every machine of the job
HOST = "DTRAIN_PS_HOST"  # the address servers bind and publish
SNAPSHOT_DIR = "DTRAIN_PS_SNAPSHOT_DIR"
SNAPSHOT_EVERY = "DTRAIN_PS_SNAPSHOT_EVERY"


def new_secret() -> str:
    """A fresh random key for one job (hex)."""
    return secrets.token_hex(32)


def _need(name: str) -> str:
    value = os.environ.get(name)
    if value is None:
        raise DtrainError(f"{name} is not set: start parameter-server jobs with `dtrain run "
                          "--servers S`, or pass servers, rank and secret to ps.Worker")
    return value


def secret() -> bytes:
    """The job's shared key."""
    try:
        return bytes.fromhex(_need(SECRET))
    except ValueError:
        raise ConfigError(f"{SECRET} must be hex (for example from `openssl rand -hex 32`)"
                          ) from None


def worker_index() -> int:
    """This worker's index among the job's workers."""
    return int(_need(INDEX))


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
    n = int(_need(SERVERS))
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
    index = int(_need(INDEX))
    host = os.environ.get(HOST, "127.0.0.1")
    server = Server(int(_need(WORKERS)), secret(), index=index, bind=f"tcp://{host}:0",
                    snapshot_dir=os.environ.get(SNAPSHOT_DIR) or None,
                    snapshot_every=int(os.environ.get(SNAPSHOT_EVERY, "0")))
    _store(120.0).set(_key(index), server.address)
    server.serve()
