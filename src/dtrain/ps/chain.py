"""Which servers hold a copy of each shard, and in what order (chain replication).

With `copies` = R, shard k lives on server slots k, k+1, ..., k+R-1 (mod S): slot k is its
primary, the others its backups, in chain order (van Renesse and Schneider, OSDI 2004; the
parameter server's replication, Li et al., OSDI 2014, section 4.3). The first live server
of the chain is the head: workers send it their pushes and pulls, it passes each update
down the chain, and it acknowledges a push only once the last live copy has it. When the
head dies, the next live server of the chain is the head.

A slot is a place, not a process: when the server in a slot dies, a new process takes
the slot (dtrain.ps.server, `join`) and joins each chain its slot belongs to at the
tail, where chain replication adds a server (the tail streams it its state, then
forwards it every update after that cut). So a chain's order is the slots' order at
first, and changes as servers are replaced: a `Chain` is one process's view of one
shard's live members, slot and address each, in order. Servers pass theirs to the workers
with every answer, so that a worker knows a new member before it needs it as a head.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass


def holders(shard: int, servers: int, copies: int) -> list[int]:
    """The slots holding copies of `shard`, primary first."""
    return [(shard + i) % servers for i in range(copies)]


def held_by(slot: int, servers: int, copies: int) -> list[int]:
    """The shards whose copies `slot` holds: its own first, then those it backs up."""
    return [(slot - i) % servers for i in range(copies)]


@dataclass(frozen=True)
class Member:
    """One live copy of a shard: the slot it fills and the address of its process."""

    slot: int
    address: str


@dataclass
class Chain:
    """One shard's live copies in chain order, as one process knows them."""

    members: list[Member]

    @classmethod
    def first(cls, shard: int, addresses: Sequence[str], copies: int) -> Chain:
        """The chain of `shard` as a job starts: its slots in order, at `addresses` (every
        server's, by slot)."""
        return cls([Member(s, addresses[s]) for s in holders(shard, len(addresses), copies)])

    @property
    def addresses(self) -> list[str]:
        return [m.address for m in self.members]

    @property
    def head(self) -> Member | None:
        """The first live copy (None: every copy is lost)."""
        return self.members[0] if self.members else None

    def after(self, address: str) -> Member | None:
        """The copy after the one at `address` (None: that one is the tail)."""
        at = self.addresses.index(address)
        return self.members[at + 1] if at + 1 < len(self.members) else None

    def of_slot(self, slot: int) -> Member | None:
        """The member filling `slot`, if one does."""
        return next((m for m in self.members if m.slot == slot), None)

    def remove(self, gone: Collection[str]) -> None:
        """Leave out the members at the addresses `gone`."""
        self.members = [m for m in self.members if m.address not in gone]

    def start_at(self, address: str) -> None:
        """Make the member at `address` the head: the ones before it are gone."""
        self.members = self.members[self.addresses.index(address):]

    def add(self, member: Member) -> None:
        """Append `member` at the tail (once)."""
        if member not in self.members:
            self.members.append(member)

    def to_json(self, leaving_out: Collection[str] = ()) -> list[list[int | str]]:
        """[[slot, address], ...] in order, without the addresses `leaving_out`."""
        return [[m.slot, m.address] for m in self.members if m.address not in leaving_out]

    @classmethod
    def from_json(cls, data: object) -> Chain:
        """A chain from `to_json`'s form.

        Raises:
            ValueError: it is not a list of [slot, address] pairs.
        """
        if not isinstance(data, list) or not all(
                isinstance(m, list) and len(m) == 2 and isinstance(m[0], int)
                and not isinstance(m[0], bool) and m[0] >= 0 and isinstance(m[1], str)
                for m in data):
            raise ValueError(f"a chain is a list of [slot, address] pairs, not {data!r}")
        return cls([Member(slot, address) for slot, address in data])
