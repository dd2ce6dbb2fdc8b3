"""A new server taking a dead one's slot: its requests to join each chain of that slot.

The new process (started by the launcher that ran the dead one, dtrain.launch.roles, or
anywhere else: another machine when that one is lost) knows the job's servers by slot,
the dead one's address among them. For every shard it asks a server holding a copy (the
shard's primary slot, or the next) to let it join; that server answers:

- "joined": the shard's head admitted it as the chain's new tail, its state came from the
  copy before it (dtrain.ps.handoff), and every copy acknowledged the join;
- "not your shard": the slot holds no copy of it (fewer copies than servers), or another
  new process already took the slot (the first to ask wins);
- "ask the head": the chain as that server knows it, whose head is asked next;
- anything else (not seeded yet, a join still in progress, no answer): asked again after
  `RETRY_S`, of the next holder in turn.

The head drops the dead address from its chain as it admits the new one, so a head whose
workers have not yet seen the old one go takes its shard over then; a server the old one
was relaying to does the same as the join passes (dtrain.ps.server).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dtrain.ps import chain
from dtrain.ps.chain import Chain, Member
from dtrain.ps.wire import BadMessage, Message

log = logging.getLogger("dtrain.ps")
RETRY_S = 2.0


@dataclass(frozen=True)
class Request:
    """A join request's content: who joins, in which slot, in place of which address."""

    joiner: Member
    replaces: str

    def meta(self) -> dict[str, object]:
        return {"slot": self.joiner.slot, "address": self.joiner.address,
                "replaces": self.replaces}

    @classmethod
    def of(cls, m: Message, servers: int) -> Request:
        """The request (or relayed join) `m` carries.

        Raises:
            BadMessage: its meta lacks a slot of the job, an address, or the replaced one.
        """
        meta = m.meta or {}
        slot, address, replaces = meta.get("slot"), meta.get("address"), meta.get("replaces")
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < servers \
                or not isinstance(address, str) or not isinstance(replaces, str) \
                or m.shard is None:
            raise BadMessage(f"malformed join of shard {m.shard}: {meta!r}")
        return cls(Member(slot, address), replaces)


class Joining:
    """The shards a new server in `slot` still has to join, and whom it asked.

    Args:
        slot: the slot it takes.
        address: its own address.
        peers: every server's address by slot, the dead one's at `slot`.
    """

    def __init__(self, slot: int, address: str, peers: list[str]) -> None:
        if peers[slot] == address:
            raise ValueError(f"server {slot} joins at {address}, the address of the server it "
                             "replaces: bind another port")
        self.request = Request(Member(slot, address), peers[slot])
        self.peers = peers
        self.asked: dict[int, tuple[str, float]] = {}
        """shard -> the server asked, and when."""
        self.joined: list[int] = []
        self.started = False
        self.copies: int | None = None
        """The job's copies of each shard, once a server's answer said (every answer to a
        join does): then only the slot's shards, and their holders, are asked."""

    @property
    def done(self) -> bool:
        return self.started and not self.asked

    def message(self, shard: int) -> Message:
        return Message("join", -1, 0, meta=self.request.meta(), shard=shard)

    def holders(self, shard: int, dead: set[str]) -> list[str]:
        """The servers that may hold a copy of `shard`, in chain order at the job's start
        (every server until the copies are known), but this slot and those seen dead."""
        servers = len(self.peers)
        return [self.peers[s] for s in chain.holders(shard, servers, self.copies or servers)
                if s != self.request.joiner.slot and self.peers[s] not in dead]

    def first(self, dead: set[str]) -> list[tuple[int, str]]:
        """Whom to ask about each shard at the start: (shard, address)."""
        self.started = True
        return [(k, asked[0]) for k in range(len(self.peers))
                if (asked := self.holders(k, dead))]

    def answered(self, answer: Message, dead: set[str]) -> str | None:
        """Take an answer to a join request; the server to ask again at once (a redirect
        to the head), else None."""
        k = answer.shard
        if k is None or k not in self.asked:
            return None
        meta = answer.meta or {}
        copies = meta.get("copies")
        if self.copies is None and isinstance(copies, int) and 0 < copies <= len(self.peers):
            self.copies = copies
            held = chain.held_by(self.request.joiner.slot, len(self.peers), copies)
            for other in [s for s in self.asked if s not in held]:
                del self.asked[other]
            if k not in self.asked:
                return None
        if not answer.error:
            del self.asked[k]
            self.joined.append(k)
            return None
        if meta.get("held") is False:
            del self.asked[k]
            log.info("shard %d: %s", k, answer.error)
            return None
        if "chain" in meta:
            try:
                head = Chain.from_json(meta["chain"]).head
            except ValueError:
                head = None
            if head is not None and head.address not in dead \
                    and head.address != self.request.joiner.address:
                return head.address
        log.info("shard %d: join not taken yet (%s); asking again", k, answer.error)
        return None

    def due(self, now: float, dead: set[str]) -> list[tuple[int, str]]:
        """The requests to send again now (no answer, or a refusal, `RETRY_S` ago): each to
        the holder after the one asked last, in turn."""
        again = []
        for k, (address, when) in self.asked.items():
            if now - when < RETRY_S:
                continue
            holders = self.holders(k, dead)
            if not holders:
                continue
            turn = holders.index(address) + 1 if address in holders else 0
            again.append((k, holders[turn % len(holders)]))
        return again
