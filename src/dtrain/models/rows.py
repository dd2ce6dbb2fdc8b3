"""Rows of several documents, as a model's forward is given them: what its attention
and positions need (`PackedDocuments`), and its loss's share of the step's (`weighted`).

A packed row (dtrain.data.packing) gives each token its place in its own document,
`positions` (batch, time), 0 where a document starts; attention stays inside each
document (dtrain.masks), so packed documents train as if each were alone in its row, and
their rotary or learned positions are those `positions` too. On CPU the mask is a dense
boolean tensor for scaled_dot_product_attention, time x time per row; on CUDA, dtrain's
own attention takes flex attention's block mask instead (dtrain.masks); under context
parallelism the ranks' attention builds its own from the positions.

`weighted` scales a model's mean loss over its own targets to its share of a step's mean
over all targets (dtrain.data.sequences.Batch.shared).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dtrain.errors import DtrainError
from dtrain.masks import document_block_mask, document_mask, flex_available

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


@dataclass(frozen=True)
class PackedDocuments:
    """The packed documents of a forward's rows, passed down to every attention.

    Attributes:
        positions: each of the rows' tokens' place in its document (batch, time): under
            context parallelism, of this rank's chunks.
        mask: the block-causal mask: dense (batch, 1, time, time), or on CUDA flex
            attention's BlockMask; None under context parallelism, whose attention
            builds its own from `positions`.
    """

    positions: torch.Tensor
    mask: torch.Tensor | BlockMask | None

    @classmethod
    def of(cls, positions: torch.Tensor, context_parallel: bool, flex: bool = False
           ) -> PackedDocuments:
        """The documents at `positions`; with `flex`, where flex attention runs (CUDA),
        their mask as a BlockMask (dtrain's own attention takes one; a transformers
        model's SDPA takes the dense mask)."""
        if context_parallel:
            return cls(positions, None)
        if flex and flex_available(positions.device):
            return cls(positions, document_block_mask(positions))
        return cls(positions, document_mask(positions))

    @classmethod
    def given(cls, positions: torch.Tensor | None, context_parallel: bool,
              cached: bool, flex: bool = False) -> PackedDocuments | None:
        """What a model's `use_documents(positions)` keeps: the documents at `positions`
        (`of`), None for rows of one sequence each.

        Raises:
            DtrainError: documents for a model generating with a KV cache (`cached`),
                which runs one sequence per row.
        """
        if positions is None:
            return None
        if cached:
            raise DtrainError("packed documents (positions) with a KV cache: generation "
                              "runs one sequence per row")
        return cls.of(positions, context_parallel, flex)



def weighted(loss: torch.Tensor, weight: float | None, anchor: torch.Tensor) -> torch.Tensor:
    """`loss` (the mean over this batch's targets) times `weight`; where the batch holds no
    target (weight 0), a zero that still depends on `anchor`, so backward runs (and its
    collectives with it) with zero gradients instead of the mean's 0 / 0: the logits, or a
    loss that is finite without targets (the chunked loss, dtrain.models.chunked_loss,
    whose head gets its zero gradient through it)."""
    if weight is None:
        return loss
    if weight == 0:
        return anchor.float().sum() * 0.0
    return loss * weight
