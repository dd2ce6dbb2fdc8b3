"""Parameter-server messages: a JSON header, an HMAC, and raw tensor bytes. No pickle.

A message is three ZeroMQ frames: the header (UTF-8 JSON: op, worker, clock, for a tensor
its dtype and length, the shard it is about, a relay number when one server passes it
down a shard's chain of copies, and an optional JSON object of settings), a 32-byte
HMAC-SHA256 of header and payload under the job's shared secret, and the payload (the
tensor's bytes, sent without a copy; empty when there is none). A structure holding
several tensors (a shard copy's whole state) travels as one message per tensor and one of
JSON that says where each goes (`split_tensors`, `join_tensors`). `unpack` checks all of it
and raises BadMessage with the reason, so a server can log and drop a malformed or forged
message and go on serving.

The HMAC is checked only once a message is whole, so every socket first caps the frames it
accepts at `frame_limit` (ZeroMQ's ZMQ_MAXMSGSIZE): a peer that announces a larger frame is
disconnected before ZeroMQ buffers a byte of it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch
import zmq

OPS = ("init", "push", "pull", "stop", "drop", "stats", "reply", "chain", "join", "part",
       "state")
SERVER_OPS = ("join", "part", "state")
"""What servers send each other beside relays: a new server's request to join a shard's
chain (and that event, relayed), and a shard copy's state in parts (dtrain.ps.server)."""
HEADER_BYTES = 64 << 10
"""The most a header may take (settings, stats of a few shard copies): far above any
legitimate one, and the margin `frame_limit` adds to a shard's bytes."""
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
_NAMES = {v: k for k, v in DTYPES.items()}


class BadMessage(ValueError):
    """A message that is malformed, forged, or does not fit the receiver's state."""


@dataclass
class Message:
    op: str
    worker: int
    clock: int
    tensor: torch.Tensor | None = None
    error: str = ""
    meta: dict[str, Any] | None = None
    shard: int | None = None
    relay: int | None = None


def frame_limit(numel: int) -> int:
    """The largest frame a job's sockets accept when the largest shard holds `numel`
    float32 values (every tensor sent is one shard, or less): its bytes, plus a header's."""
    return 4 * numel + HEADER_BYTES


def cap_frames(socket: zmq.Socket, numel: int) -> None:
    """Refuse frames larger than `frame_limit(numel)` on `socket`; set before it binds or
    connects (ZeroMQ copies the option into each connection when it is made)."""
    socket.setsockopt(zmq.MAXMSGSIZE, frame_limit(numel))


def _mac(secret: bytes, header: bytes, payload: bytes | memoryview) -> bytes:
    mac = hmac.new(secret, header, hashlib.sha256)
    mac.update(payload)
    return mac.digest()


def pack(secret: bytes, message: Message) -> list[Any]:
    """The frames of `message`, signed with `secret`; the payload frame shares the
    tensor's memory, which must not change until ZeroMQ has sent it."""
    head: dict[str, Any] = {"op": message.op, "worker": message.worker, "clock": message.clock}
    payload: Any = b""
    if message.tensor is not None:
        t = message.tensor.detach().contiguous().view(-1)
        head["dtype"], head["numel"] = _NAMES[t.dtype], t.numel()
        # an ndarray exports the buffer protocol (numpy's stubs say so from Python 3.12 on)
        payload = memoryview(t.view(torch.uint8).numpy())  # type: ignore[arg-type]
    if message.error:
        head["error"] = message.error
    if message.meta is not None:
        head["meta"] = message.meta
    for name in ("shard", "relay"):
        if getattr(message, name) is not None:
            head[name] = getattr(message, name)
    header = json.dumps(head, separators=(",", ":")).encode()
    return [header, _mac(secret, header, payload), payload]


def _is_integer(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(value: object) -> int:
    """A header's count (worker, clock): a JSON integer, not a float, string or bool."""
    if not _is_integer(value):
        raise TypeError(f"{value!r} is not an integer")
    return value


def unpack(secret: bytes, frames: list[Any]) -> Message:
    """Check and decode frames from `pack`.

    Raises:
        BadMessage: wrong frame count, bad HMAC, malformed header, unknown op or dtype,
            or a payload whose length does not match the header.
    """
    if len(frames) != 3:
        raise BadMessage(f"expected 3 frames, got {len(frames)}")
    # The payload stays a view of ZeroMQ's frame until the one copy into the tensor.
    header, mac, payload = (f.buffer if hasattr(f, "buffer") else memoryview(f) for f in frames)
    header, mac = bytes(header), bytes(mac)
    if not hmac.compare_digest(mac, _mac(secret, header, payload)):
        raise BadMessage("bad HMAC: not signed with this job's secret")
    try:
        head = json.loads(header)
        op, worker, clock = head["op"], _integer(head["worker"]), _integer(head["clock"])
    except (ValueError, KeyError, TypeError):
        raise BadMessage("malformed header") from None
    if op not in OPS:
        raise BadMessage(f"unknown op {op!r}")
    tensor = None
    if "dtype" in head:
        dtype = DTYPES.get(head["dtype"]) if isinstance(head["dtype"], str) else None
        if dtype is None:
            raise BadMessage(f"unsupported dtype {head['dtype']!r}")
        numel = head.get("numel")
        if not _is_integer(numel):
            raise BadMessage(f"malformed header: numel {numel!r} is not an integer")
        if numel < 0 or numel * dtype.itemsize != len(payload):
            raise BadMessage(f"payload of {len(payload)} bytes does not hold {numel} "
                             f"{head['dtype']} values")
        tensor = (torch.frombuffer(bytearray(payload), dtype=dtype) if numel
                  else torch.empty(0, dtype=dtype))
    elif payload:
        raise BadMessage("payload without a dtype")
    meta = head.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise BadMessage("malformed header: meta is not an object")
    shard, relay = head.get("shard"), head.get("relay")
    for name, value in (("shard", shard), ("relay", relay)):
        if value is not None and (not _is_integer(value) or value < 0):
            raise BadMessage(f"malformed header: {name} {value!r} is not a count")
    return Message(op, worker, clock, tensor, str(head.get("error", "")), meta, shard, relay)


TENSOR_KEY = "__tensor__"


def split_tensors(value: object) -> tuple[object, list[torch.Tensor]]:
    """`value` (dicts with string keys, lists, tuples, numbers, strings, None and tensors,
    nested) as JSON, each tensor replaced by {TENSOR_KEY: its place, "shape": ...}, and
    the tensors in that order, flattened, to be sent one a message.

    Raises:
        ValueError: a tensor of a dtype the wire does not carry, or a value JSON lacks.
    """
    tensors: list[torch.Tensor] = []

    def walk(v: object) -> object:
        if isinstance(v, torch.Tensor):
            if v.dtype not in _NAMES:
                raise ValueError(f"a {v.dtype} tensor does not travel between servers")
            tensors.append(v.detach().reshape(-1))
            return {TENSOR_KEY: len(tensors) - 1, "shape": list(v.shape)}
        if isinstance(v, dict):
            return {str(k): walk(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [walk(x) for x in v]
        if v is None or isinstance(v, bool | int | float | str):
            return v
        raise ValueError(f"{type(v).__name__} {v!r} does not travel between servers")

    return walk(value), tensors


def join_tensors(value: object, tensors: list[torch.Tensor]) -> object:
    """`split_tensors`' JSON with its tensors put back in place.

    Raises:
        BadMessage: a place or shape that the tensors received do not fit.
    """
    if isinstance(value, dict) and TENSOR_KEY in value:
        place, shape = value[TENSOR_KEY], value.get("shape")
        if not _is_integer(place) or not 0 <= place < len(tensors) \
                or not isinstance(shape, list) or not all(_is_integer(n) for n in shape):
            raise BadMessage(f"malformed state: tensor {place!r} of shape {shape!r}")
        try:
            return tensors[place].reshape(shape)
        except RuntimeError:
            raise BadMessage(f"malformed state: tensor {place} does not have shape "
                             f"{shape}") from None
    if isinstance(value, dict):
        return {k: join_tensors(x, tensors) for k, x in value.items()}
    if isinstance(value, list):
        return [join_tensors(x, tensors) for x in value]
    return value
