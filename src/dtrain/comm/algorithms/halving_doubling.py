"""Recursive halving-doubling allreduce (Rabenseifner 2004; Thakur, Rabenseifner & Gropp 2005).

Reduce-scatter by recursive halving: in round k each rank swaps half of its current range
with the partner whose rank differs in bit k and keeps (and reduces) the other half, so
after log2 p rounds each rank holds one fully reduced block. All-gather by recursive
doubling retraces the rounds in reverse, doubling the range each time.

Non-power-of-two group sizes (the fix-up): with p' the largest power of two <= p and
r = p - p', the first 2r ranks pair up; each even one sends its vector to its odd
neighbour and sits out, the p' remaining ranks run the algorithm, and the odd ranks hand
the result back at the end.

Cost (alpha: latency per message, beta: seconds per byte, gamma: reduction, n bytes):
    2 log2(p') alpha + 2 (p'-1)/p' n beta + (p'-1)/p' n gamma   (+ 2 (alpha + n beta) if p != p')
Latency like the tree and bandwidth like the ring: good at every size for powers of two.
"""

from __future__ import annotations

import torch

from dtrain.comm.group import Group
from dtrain.comm.ops import ReduceOp, combine_, finish_, shard_offsets


def _exchange(g: Group, send: torch.Tensor, recv: torch.Tensor, peer: int) -> None:
    out = g.isend(send, peer)
    g.irecv(recv, peer).wait()
    out.wait()


def all_reduce(g: Group, flat: torch.Tensor, op: ReduceOp) -> None:
    """Allreduce `flat` in place."""
    p, rank = g.size, g.rank
    p2 = 1 << (p.bit_length() - 1)
    extra = p - p2
    # Fix-up: ranks below 2*extra pair up (even -> odd); "new" ranks number the survivors.
    if rank < 2 * extra:
        if rank % 2 == 0:
            g.isend(flat, rank + 1).wait()
            g.irecv(flat, rank + 1).wait()
            return
        scratch = g.scratch(flat)
        g.irecv(scratch, rank - 1).wait()
        combine_(flat, scratch, op)
        new = rank // 2
    else:
        new = rank - extra

    def real(new_rank: int) -> int:
        return new_rank * 2 + 1 if new_rank < extra else new_rank + extra

    bounds = shard_offsets(flat.numel(), p2)
    lo, hi = 0, p2  # block range this rank is responsible for
    scratch = g.scratch(flat)
    mask = p2 // 2
    while mask:
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if new & mask else ((lo, mid), (mid, hi))
        k0, k1 = bounds[keep[0]], bounds[keep[1]]
        g0, g1 = bounds[give[0]], bounds[give[1]]
        _exchange(g, flat[g0:g1], scratch[k0:k1], real(new ^ mask))
        combine_(flat[k0:k1], scratch[k0:k1], op)
        lo, hi = keep
        mask //= 2
    finish_(flat[bounds[lo] : bounds[hi]], op, p)
    mask = 1
    while mask < p2:
        size = hi - lo
        if new & mask:
            other = (lo - size, lo)
        else:
            other = (hi, hi + size)
        mine = flat[bounds[lo] : bounds[hi]]
        theirs = flat[bounds[other[0]] : bounds[other[1]]]
        _exchange(g, mine, theirs, real(new ^ mask))
        lo, hi = min(lo, other[0]), max(hi, other[1])
        mask <<= 1
    if rank < 2 * extra:
        g.isend(flat, rank - 1).wait()
