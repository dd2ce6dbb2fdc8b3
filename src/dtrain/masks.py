"""Which keys each query of an attention sees: causal, and cut at packed documents.

    mask = document_mask(positions)       # (batch, 1, time, time), True: may attend

A packed row (dtrain.data.packing) gives each token its place in its own document,
`positions` (batch, time), 0 where a document starts. Query i may attend to key j when
j <= i and no document starts in (j, i]: causal attention cut at every document
boundary. Under context parallelism a rank holds queries and keys at scattered global
positions (dtrain.context_parallel.chunks); `visible_keys` says the same by those: query
at global position i, whose document began at i - p, sees the keys at i - p .. i.

On CUDA the same mask is a flex-attention `BlockMask` (`document_block_mask`): blocks of
128 x 128 positions that no query sees are skipped, those wholly inside one document run
unmasked, so a row of short documents costs the sum of their squares, not the row's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


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


def flex_available(device: torch.device) -> bool:
    """Whether flex attention can run here: on CUDA, with a torch that has it (2.5 on)."""
    if device.type != "cuda":
        return False
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""flex attention's mask_mod: (row, head, query, key) -> whether the query sees the key."""


def same_document(positions: torch.Tensor) -> MaskMod:
    """The mask_mod of `document_mask`: causal, inside each row's documents."""
    document = (positions == 0).cumsum(dim=-1)

    def sees(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
             ) -> torch.Tensor:
        return (kv <= q) & (document[b, q] == document[b, kv])

    return sees


def document_block_mask(positions: torch.Tensor) -> BlockMask:
    """`document_mask` as flex attention's BlockMask (one per row, shared by the heads)."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, t = positions.shape
    return create_block_mask(same_document(positions), batch, None, t, t,
                             device=positions.device)


@functools.cache
def compiled_flex_attention():  # noqa: ANN201  # torch's compiled kernel, whatever its type
    """flex_attention compiled once: uncompiled it materializes the scores, which is what
    it exists to avoid."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)
