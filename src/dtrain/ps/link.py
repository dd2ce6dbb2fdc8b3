"""Outgoing connections to servers that notice when a server dies.

Workers connect to every server, and a server to the next copy of its shards, with a
ZeroMQ DEALER whose frames are capped (wire.cap_frames). With backups (`copies` > 1) a
connection is also watched: the kernel closes a killed process's sockets at once, and
ZeroMQ's heartbeat (a PING every second, 10 s without an answer) closes one to a machine
that stopped answering, so either way the watcher sees the connection drop and the caller moves on
to the shard's next copy (dtrain.ps.chain). Only a connection that was up and dropped
counts: a server not listening yet (still starting) is retried by ZeroMQ, and one that
never comes up is named by the caller's timeout. Without backups nothing is watched: a
server restarted on the same address (from its snapshot) is reconnected to by ZeroMQ.
"""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message

from dtrain.ps.wire import cap_frames

HEARTBEAT_MS, HEARTBEAT_TIMEOUT_MS = 1000, 10_000
GONE = zmq.EVENT_DISCONNECTED


def connect(context: zmq.Context, address: str, numel: int,
            watch: bool) -> tuple[zmq.Socket, zmq.Socket | None]:
    """A DEALER connected to `address` that accepts frames for shards of up to `numel`
    values, and, with `watch`, the socket on which its losses are reported (see `gone`)."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    cap_frames(socket, numel)
    monitor = None
    if watch:
        socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        monitor = socket.get_monitor_socket(GONE)
    socket.connect(address)
    return socket, monitor


def gone(monitor: zmq.Socket) -> bool:
    """Read one event from `monitor`: whether it says the server is gone."""
    return bool(recv_monitor_message(monitor)["event"] & GONE)


def close(socket: zmq.Socket, monitor: zmq.Socket | None) -> None:
    """Close a connection from `connect` and its watcher."""
    if monitor is not None:
        socket.disable_monitor()
        monitor.close()
    socket.close()
