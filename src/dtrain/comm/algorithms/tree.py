"""Binomial-tree reduce and broadcast, and allreduce as the two in sequence.

Ranks are renumbered relative to the root (v = (rank - root) mod p). In a binomial tree
rank v's parent is v with its lowest set bit cleared, so in round k every rank whose
lowest set bit is 2^k exchanges with the rank 2^k below it: ceil(log2 p) rounds in all.

Cost (alpha: latency per message, beta: seconds per byte, n bytes, p ranks):
    reduce, broadcast: ceil(log2 p) (alpha + n beta)
    allreduce:         2 ceil(log2 p) (alpha + n beta)
Latency-optimal — the best choice for small messages; the whole vector crosses every
level, so large messages prefer the ring or halving-doubling.
"""

from __future__ import annotations

import torch

from dtrain.comm.group import Group
from dtrain.comm.ops import ReduceOp, combine_, finish_


def reduce(g: Group, flat: torch.Tensor, root: int, op: ReduceOp) -> None:
    """Reduce `flat` onto `root` in place (other ranks' buffers end partially reduced)."""
    p = g.size
    v = (g.rank - root) % p
    scratch = g.scratch(flat)
    mask = 1
    while mask < p:
        if v & mask:
            g.isend(flat, (v - mask + root) % p).wait()
            return
        if v + mask < p:
            g.irecv(scratch, (v + mask + root) % p).wait()
            combine_(flat, scratch, op)
        mask <<= 1
    finish_(flat, op, p)


def broadcast(g: Group, flat: torch.Tensor, root: int) -> None:
    """Copy `root`'s `flat` into every rank's `flat`."""
    p = g.size
    v = (g.rank - root) % p
    mask = 1
    while mask < p:
        if v & mask:
            g.irecv(flat, (v - mask + root) % p).wait()
            break
        mask <<= 1
    mask >>= 1
    sends = []
    while mask > 0:
        if v + mask < p:
            sends.append(g.isend(flat, (v + mask + root) % p))
        mask >>= 1
    for handle in sends:
        handle.wait()


def all_reduce(g: Group, flat: torch.Tensor, op: ReduceOp) -> None:
    """Allreduce `flat` in place: reduce to rank 0, then broadcast from it."""
    reduce(g, flat, 0, op)
    broadcast(g, flat, 0)
