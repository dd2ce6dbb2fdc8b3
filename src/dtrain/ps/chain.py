"""Which servers hold a copy of each shard, and in what order (chain replication).

With `copies` = R, shard k lives on servers k, k+1, ..., k+R-1 (mod S): server k is its
primary, the others its backups, in chain order (van Renesse and Schneider, OSDI 2004; the
parameter server's replication, Li et al., OSDI 2014, section 4.3). The first live server
of the chain is the head: workers send it their pushes and pulls, it passes each update
down the chain, and it acknowledges a push only once the last live copy has it. When the
head dies, the next live server of the chain is the head. Everything here is plain
arithmetic, shared by servers and workers so that both agree on who holds what.
"""

from __future__ import annotations

from collections.abc import Collection


def holders(shard: int, servers: int, copies: int) -> list[int]:
    """The servers holding copies of `shard`, primary first."""
    return [(shard + i) % servers for i in range(copies)]


def head(shard: int, servers: int, copies: int, dead: Collection[int]) -> int | None:
    """The first live holder of `shard` (None: every copy is lost)."""
    return next((s for s in holders(shard, servers, copies) if s not in dead), None)


def after(shard: int, server: int, servers: int, copies: int,
          dead: Collection[int]) -> int | None:
    """The next live holder of `shard` after `server` in its chain (None: `server` is the
    last live copy, the tail)."""
    chain = holders(shard, servers, copies)
    return next((s for s in chain[chain.index(server) + 1 :] if s not in dead), None)
