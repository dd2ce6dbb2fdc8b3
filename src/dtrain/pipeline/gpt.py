"""dtrain's GPT cut into pipeline pieces: the embedding on the first, the head on the last.

A piece holds the GPT's own submodules under their own names (`blocks.3` stays
`blocks.3`), so a piece's state_dict is a slice of the GPT's. The head shares its weight
with the token embedding; when they sit on different ranks, `tied_weights` names the pair
so the Pipeline sums their gradients, as autograd does for one shared weight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dtrain import comm
from dtrain.models.gpt import GPT
from dtrain.pipeline.partition import stage_sizes


class GPTPiece(nn.Module):
    """Consecutive blocks of a GPT, with its embedding (first piece) or head (last piece)."""

    def __init__(self, gpt: GPT, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in blocks})
        if last:
            self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def gpt_pieces(gpt: GPT, parts: int, balance: str | Sequence[int] = "params") -> list[GPTPiece]:
    """Cut `gpt` into `parts` pieces of consecutive blocks (pp x virtual stages).

    Raises:
        ConfigError: more pieces than blocks, or explicit sizes that do not fit.
    """
    sizes = stage_sizes(list(gpt.blocks), parts, balance)
    pieces, start = [], 0
    for i, size in enumerate(sizes):
        pieces.append(GPTPiece(gpt, range(start, start + size), i == 0, i == parts - 1))
        start += size
    return pieces


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's loss on the last piece's output."""
    return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def gpt_loss_of(gpt: GPT) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss of `gpt` as it computes it (vocab-parallel once tensor parallelism has
    replaced its `loss_fn`), for the last piece's output."""
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return gpt.loss_fn(logits.view(-1, logits.size(-1)), targets.view(-1))

    return loss


def release_others(gpt: GPT, mine: Sequence[nn.Module]) -> None:
    """Free the storage of every parameter of `gpt` that none of this rank's pieces holds:
    each rank builds the whole model (so every rank draws the same initial weights), then
    keeps only its stages. The names and shapes stay known; the values are gone."""
    kept = {id(p) for piece in mine for p in piece.parameters()}
    for p in gpt.parameters():
        if id(p) not in kept:
            p.data = p.data.new_empty(0)


def tied_weights(gpt: GPT, mine: Sequence[GPTPiece], group: Any = None) -> list:
    """The (parameter, peer) pairs for `Pipeline(tied=...)`: the embedding on the first
    stage's rank and the head on the last's, when those are different ranks."""
    g = comm.resolve(group)
    if g.size == 1:
        return []
    pairs = []
    if any(p.first for p in mine):
        pairs.append((gpt.wte.weight, g.size - 1))
    if any(p.last for p in mine):
        pairs.append((gpt.head.weight, 0))
    return pairs
