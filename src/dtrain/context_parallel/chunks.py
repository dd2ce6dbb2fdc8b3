"""Which tokens of a sequence each context-parallel rank holds, and where they sit.

Under causal attention the later tokens of a sequence attend to more keys than the early
ones, so cutting a sequence into N contiguous parts would give the last rank most of the
work. Instead the sequence is cut into 2N equal chunks and rank i of the N keeps chunks i
and 2N-1-i (an early one and its mirror), so that every rank attends over the same number
of key-query pairs:

    N = 2, chunks 0 1 2 3:   rank 0 holds 0 and 3, rank 1 holds 1 and 2
"""

from __future__ import annotations

import torch

from dtrain.errors import ConfigError


def check_length(length: int, size: int, what: str = "the sequence") -> None:
    """Raise unless `length` tokens cut into 2 x `size` equal chunks.

    Raises:
        ConfigError: it does not divide.
    """
    if length % (2 * size):
        raise ConfigError(f"{what} of {length} tokens does not cut into 2 x cp = {2 * size} "
                          "equal chunks: make it a multiple of 2 x cp")


def shard(x: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s two chunks of `x` along `dim` (the sequence), concatenated: chunk
    `rank` then chunk 2 x size - 1 - rank.

    Raises:
        ConfigError: the length does not cut into 2 x size chunks.
    """
    if size == 1:
        return x
    check_length(x.shape[dim], size)
    chunks = x.chunk(2 * size, dim=dim)
    return torch.cat((chunks[rank], chunks[2 * size - 1 - rank]), dim=dim)


def unshard(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's `shard`, in rank order (the inverse)."""
    size = len(parts)
    if size == 1:
        return parts[0]
    halves = [p.chunk(2, dim=dim) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


def positions(local: int, rank: int, size: int,
              device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions of the `local` tokens rank `rank` holds (its two chunks)."""
    chunk = local // 2
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    mirror = 2 * size - 1 - rank
    return torch.cat((first, torch.arange(mirror * chunk, (mirror + 1) * chunk, device=device)))


def every_position(local: int, size: int,
                   device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions of every rank's `local` tokens, in rank order (the sequence as
    an all-gather over the group lays it out)."""
    return torch.cat([positions(local, rank, size, device) for rank in range(size)])
