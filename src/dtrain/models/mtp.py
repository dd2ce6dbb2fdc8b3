"""Multi-token prediction (MTP): DeepSeek-V3's sequential modules, which train each position
to predict tokens further ahead than the next one.

    [model]
    mtp_depth = 1              # D modules (0: off)
    mtp_loss_weight = 0.3      # lambda

Module k (1..D) predicts, at position i, the token at i + k + 1. Its input at i is the
previous depth's hidden state h^{k-1}_i (h^0: the main model's last block output, before
its final norm) and the embedding of the token at i + k (the main model's embedding):

    h'_i = eh_proj [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]
    h^k  = the module's transformer block (h')        (causal over the row, as the model's)
    logits_k = the main model's output head (RMSNorm_k(h^k))

The loss of depth k is the cross-entropy of those logits against t_{i+k+1} over the
positions that have one; the MTP loss is `mtp_loss_weight` / D x their sum, added to the
training loss while training (evaluation and generation see the main model alone, whose
logits MTP leaves unchanged: DeepSeek-V3 drops the modules at inference or uses them to
draft tokens).

The concatenation is (embedding, hidden): the order of DeepSeek's published weights (the
`eh_proj` of their model.layers.61, as vLLM and SGLang read it; the paper writes the
hidden state first). The parameter names are theirs too: `enorm`, `hnorm`, `eh_proj`, and
the final norm `shared_head.norm` (here `norm`).

Rows keep their length: depth k reads the tokens shifted by k, the last k positions of each
row wrap around and have no target (causal attention keeps them out of every earlier
position), so the rotary angles, the packed documents' masks and the block's shapes are the
main model's. In packed rows a position whose token k ahead lies in the next document has
no target either.

Under context parallelism (the model's `context`) a rank holds two chunks of each row, and
the tokens k ahead of its last positions are in other ranks' chunks: the rows' token ids,
targets and document positions (integers) are all-gathered once per forward over the cp
group, shifted as above on the whole rows, and each rank keeps its chunks' part. A cp
group's MTP loss is the mean over the whole rows' targets of each depth: a rank's mean over
its own targets weighs by its share of the group's (the last k positions of a row are all
on rank 0's second chunk), and by the group's mean next-token `weight`. One all-reduce of
those counts per forward.

Under pipeline parallelism the modules go with the last stage (Llama.stage_parts), with a
copy of the embedding they read: the pipeline ties it to the first stage's (their
gradients summed after each step, as a head tied to the embedding is,
dtrain.pipeline.tied_weights), and gives the last stage each micro-batch's token ids
besides its targets (dtrain.pipeline.Piece's `ahead`). The V-shaped schedules (zbv,
dualpipev) hold the first and last stages on one rank and are refused with MTP
(dtrain.models.rules). Under tensor parallelism the modules stay whole on every tp rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from dtrain import comm
from dtrain.context_parallel import ContextParallel, chunks
from dtrain.context_parallel.exchange import whole_sequence
from dtrain.data.sequences import IGNORE
from dtrain.models.llama_parts import RMSNorm


class PredictsAhead(Protocol):
    """What the modules need of the main model: its embedding, one of its blocks run at
    this forward's positions, its head and loss, and its context parallelism
    (dtrain.models.stages.StagedLM)."""

    context: ContextParallel | None

    def stage_in(self, idx: torch.Tensor) -> torch.Tensor: ...

    def stage_block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor: ...

    def head_loss(self, final: torch.Tensor, targets: torch.Tensor, weight: float | None
                  ) -> tuple[torch.Tensor | None, torch.Tensor]: ...


class PredictionDepth(nn.Module):
    """One MTP module: two RMSNorms, the projection of their concatenation, a transformer
    block (`block`, of the main model's kind) and a final RMSNorm."""

    def __init__(self, dim: int, eps: float, block: nn.Module) -> None:
        super().__init__()
        self.enorm = RMSNorm(dim, eps)
        self.hnorm = RMSNorm(dim, eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = RMSNorm(dim, eps)

    def forward(self, model: PredictsAhead, embedded: torch.Tensor, hidden: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this depth's hidden states, the same through its final norm), from the
        embeddings of the tokens it reads and the previous depth's hidden states (before
        any final norm). Every parameter is used inside this call: ZeRO-3 holds a depth's
        parameters for its forward alone."""
        h = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1))
        h = model.stage_block(self.block, h)
        return h, self.norm(h)


def shifted_targets(targets: torch.Tensor, k: int, positions: torch.Tensor | None
                    ) -> torch.Tensor:
    """The targets of depth k: at position i the main targets' at i + k, IGNORE at the last
    k positions of each row and, in packed rows (`positions`: each token's place in its
    document), where the token k ahead is in another document."""
    ahead = torch.roll(targets, -k, dims=1)
    ahead[:, -k:] = IGNORE
    if positions is not None:
        same_document = torch.roll(positions, -k, dims=1) == positions + k
        ahead = ahead.masked_fill(~same_document, IGNORE)
    return ahead


class MultiTokenPrediction(nn.Module):
    """DeepSeek-V3's MTP modules: `blocks[k]` is depth k + 1's transformer block.

    Args:
        blocks: one transformer block per depth, built by the main model.
        dim: the residual stream's width.
        eps: the RMSNorms' epsilon.
        loss_weight: lambda: the MTP loss is lambda / D x the sum of the depths' losses.
    """

    def __init__(self, blocks: Sequence[nn.Module], dim: int, eps: float,
                 loss_weight: float) -> None:
        super().__init__()
        self.depths = nn.ModuleList(PredictionDepth(dim, eps, block) for block in blocks)
        self.loss_weight = loss_weight

    def forward(self, model: PredictsAhead, idx: torch.Tensor, hidden: torch.Tensor,
                targets: torch.Tensor, weight: float | None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """The weighted MTP loss of one forward.

        Args:
            model: the main model (its embedding, block calls, head and loss).
            idx: the forward's token ids (batch, time).
            hidden: the main model's last block output (batch, time, dim).
            targets: the next-token targets (batch, time).
            weight: the loss's share of the step's (dtrain.models.rows.weighted), as the
                main loss is weighed.
            positions: packed rows' places of each token in its document (None: one
                sequence per row).
        """
        cp = model.context if model.context is not None and model.context.size > 1 else None
        weights: Sequence[float | None]
        if cp is None:
            aheads = [(torch.roll(idx, -k, dims=1), shifted_targets(targets, k, positions))
                      for k in range(1, len(self.depths) + 1)]
            weights = [weight] * len(aheads)
        else:
            aheads, weights = chunks_ahead(cp, len(self.depths), idx, targets, positions,
                                           weight)
        losses = []
        for depth, (tokens, ahead), share in zip(self.depths, aheads, weights, strict=True):
            hidden, final = depth(model, model.stage_in(tokens), hidden)
            losses.append(model.head_loss(final, ahead, share)[1])
        return self.loss_weight * torch.stack(losses).mean()


def chunks_ahead(cp: ContextParallel, depths: int, idx: torch.Tensor, targets: torch.Tensor,
                 positions: torch.Tensor | None, weight: float | None
                 ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[float]]:
    """Under context parallelism: for each depth k, this rank's chunks of the tokens k
    ahead and of depth k's targets (shifted on the whole rows, gathered over `cp`), and
    the weight of this rank's mean loss over its targets of depth k: its share of the cp
    group's targets (x cp: the trainer averages over cp) times the group's mean `weight`
    (1 where None). See the module doc."""
    whole = [whole_sequence(t, cp.group) for t in (idx, targets)]
    every_position = None if positions is None else whole_sequence(positions, cp.group)
    aheads = []
    for k in range(1, depths + 1):
        tokens = chunks.shard(torch.roll(whole[0], -k, dims=1), cp.rank, cp.size)
        ahead = chunks.shard(shifted_targets(whole[1], k, every_position), cp.rank, cp.size)
        aheads.append((tokens, ahead))
    if isinstance(idx, FakeTensor):  # the planner's trace (dtrain.planner.traced): shapes
        return aheads, [1.0 if weight is None else weight] * depths  # only, nothing to count
    counts = torch.tensor([float((ahead != IGNORE).sum()) for _, ahead in aheads]
                          + [1.0 if weight is None else weight], dtype=torch.float64,
                          device=idx.device)
    *totals, summed_weight = comm.all_reduce(counts.clone(), group=cp.group).tolist()
    group_weight = summed_weight / cp.size
    weights = [mine * cp.size / max(1.0, total) * group_weight
               for mine, total in zip(counts.tolist()[:-1], totals, strict=True)]
    return aheads, weights
