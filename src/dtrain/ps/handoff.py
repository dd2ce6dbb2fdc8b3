"""A shard copy's whole state on its way to a server that joins the shard's chain.

Chain replication adds a server at the tail (van Renesse and Schneider, OSDI 2004,
section 3): the tail sends it its state, then forwards it every update it applies after
that cut, in order, over the same connection. Here the state is a shard copy's `state()`
(dtrain.ps.shard: values, optimizer state, clocks, the sync round being gathered,
counters) and the chain as the sender knows it: one "part" message per tensor (each at
most a shard long, so every socket's frame cap holds), then one "state" message of JSON
saying where each part goes (dtrain.ps.wire.split_tensors). Nothing is acknowledged:
the relays that follow on the same connection are, and a server acknowledges one only
once it holds the state before it. Nothing received is unpickled.
"""

from __future__ import annotations

from typing import Any

import torch

from dtrain.ps.chain import Chain
from dtrain.ps.shard import ShardCopy
from dtrain.ps.wire import BadMessage, Message, join_tensors, split_tensors


def messages(shard: int, copy: ShardCopy, chain: Chain) -> list[Message]:
    """What gives a joining server `copy`'s state as of now, and `chain` (which lists it):
    copies of the tensors (ZeroMQ sends from their memory later, and the next update
    changes the copy's own)."""
    value, tensors = split_tensors(copy.state())
    return [*(Message("part", -1, 0, t.clone(), shard=shard) for t in tensors),
            Message("state", -1, 0, meta={"state": value, "chain": chain.to_json()},
                    shard=shard)]


class Incoming:
    """The states being received, each from one sender's connection about one shard."""

    def __init__(self) -> None:
        self._parts: dict[tuple[bytes, int], list[torch.Tensor]] = {}

    def part(self, sender: bytes, m: Message) -> None:
        """Keep one part of the state `sender` is sending about shard `m.shard`.

        Raises:
            BadMessage: it carries no tensor.
        """
        if m.tensor is None or m.shard is None:
            raise BadMessage("a part of a shard's state without a tensor or a shard")
        self._parts.setdefault((sender, m.shard), []).append(m.tensor)

    def state(self, sender: bytes, m: Message) -> tuple[dict[str, Any], Chain]:
        """The state whose parts `sender` sent before `m`, and the chain it lists.

        Raises:
            BadMessage: the JSON does not fit the parts received, or is not a state.
        """
        parts = self._parts.pop((sender, m.shard if m.shard is not None else -1), [])
        meta = m.meta or {}
        try:
            state, chain = join_tensors(meta["state"], parts), Chain.from_json(meta["chain"])
        except BadMessage:
            raise
        except (KeyError, ValueError) as exc:
            raise BadMessage(f"malformed state of a shard: {exc}") from None
        if not isinstance(state, dict):
            raise BadMessage("malformed state of a shard: not an object")
        return state, chain
