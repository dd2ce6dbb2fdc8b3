"""Rows of several documents: attention that stays inside each, and a loss share.

    mask = document_mask(positions)         # (batch, 1, time, time), True: may attend

A packed row (dtrain.data.packing) gives each token its place in its own document,
`positions` (batch, time), 0 where a document starts. Query i may attend to key j when
j <= i and no document starts in (j, i]: causal attention cut at every document
boundary, so packed documents train as if each were alone in its row (their rotary or
learned positions are those `positions` too). On CPU the mask is a dense boolean tensor
for scaled_dot_product_attention, time x time per row.

`weighted` scales a model's mean loss over its own targets to its share of a step's mean
over all targets (dtrain.data.sequences.Batch.weight).
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


def weighted(loss: torch.Tensor, weight: float | None, logits: torch.Tensor) -> torch.Tensor:
    """`loss` (the mean over this batch's targets) times `weight`; where the batch holds no
    target (weight 0), a zero that still depends on `logits`, so backward runs (and its
    collectives with it) with zero gradients instead of the mean's 0 / 0."""
    if weight is None:
        return loss
    if weight == 0:
        return logits.float().sum() * 0.0
    return loss * weight
