"""The job's rendezvous: torch's static TCP rendezvous, its store listening on one address.

Node 0 hosts the store every rank meets in (`--master HOST:PORT`). torch's static
rendezvous lets that store listen on every interface of the machine, so anyone who can
reach it could write into a job. dtrain opens the listening socket itself, bound to the
master's address only (127.0.0.1 for a one-machine job), and hands it to the store.

One machine also needs no free-port guess: the socket binds port 0 and the kernel picks.
"""

from __future__ import annotations

import errno
import socket

from dtrain.errors import LaunchError

BACKEND = "dtrain-static"


def listen(host: str, port: int) -> tuple[int, int]:
    """Listen on `host`:`port` (port 0: any free one) for the store: (file descriptor, port).
    The descriptor is the store's to close.

    Raises:
        LaunchError: the port is in use, or `host` is not an address of this machine.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise LaunchError(f"port {port} on {host} is in use: pass --master "
                              f"{host}:<free port>") from None
        raise LaunchError(f"node 0 cannot listen on --master {host}:{port} ({exc.strerror or exc})"
                          ": give an address of this machine") from None
    bound = sock.getsockname()[1]
    return sock.detach(), bound


def register() -> None:
    """Make BACKEND known to torch's elastic agent (again is fine)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create)


def _create(params):  # a RendezvousHandler for torch's registry
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler

    handler = create_rdzv_handler(params)
    handler.get_backend = lambda: BACKEND  # the agent checks it is the backend it asked for
    fd = params.get_as_int("listen_fd")
    if fd is not None:  # node 0: the store serves on dtrain's socket
        handler._store = TCPStore(handler.master_addr, handler.master_port, handler.world_size,
                                  True, handler.timeout, multi_tenant=True, master_listen_fd=fd)
    return handler
