"""Which keys each query of an attention sees: causal, and cut at packed documents.

    mask = document_mask(positions)       # (batch, 1, time, time), True: may attend

A packed row (dtrain.data.packing) gives each token its place in its own document,
`positions` (batch, time), 0 where a document starts. Query i may attend to key j when
j <= i and no document starts in (j, i]: causal attention cut at every document
boundary. Under context parallelism a rank holds queries and keys at scattered global
positions (dtrain.context_parallel.chunks); `visible_keys` says the same by those: query
at global position i, whose document began at i - p, sees the keys at i - p .. i.
"""

from __future__ import annotations

import torch


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """The block-causal mask of rows whose documents restart at position 0: (batch, 1,
    time, time) bool, True where query i may attend to key j."""
    document = (positions == 0).cumsum(dim=-1)
    t = positions.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=positions.device).tril()
    return ((document[:, :, None] == document[:, None, :]) & causal)[:, None]


def visible_keys(queries: torch.Tensor, keys: torch.Tensor, starts: torch.Tensor | None
                 ) -> torch.Tensor:
    """Which keys each query sees, by global positions (`queries` (time,), `keys`
    (keys,)): the causal mask (time, keys), or with each query's document's first
    position `starts` (batch, time) the block-causal one (batch, 1, time, keys)."""
    causal = keys[None, :] <= queries[:, None]
    if starts is None:
        return causal
    return (causal[None] & (keys[None, None, :] >= starts[:, :, None]))[:, None]
