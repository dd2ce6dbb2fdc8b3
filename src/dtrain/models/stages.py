"""How a model tells the pipeline where to cut it: the `Stages` protocol.

A decoder-only language model is an input part (embeddings), a run of blocks, and an
output part (final norm, head). A model that names those parts can be cut into pipeline
stages by its blocks (dtrain.pipeline.cut): the first stage runs the input part, the last
the output part, every stage its consecutive blocks.

    class MyLM(nn.Module):
        def stage_parts(self):                      # module names, as in named_modules()
            return ["tok", "pos"], "layers", ["norm", "head"]
        def stage_in(self, idx):   return self.tok(idx) + self.pos(...)
        def stage_block(self, block, h):  return block(h)
        def stage_out(self, h):    return self.head(self.norm(h))

dtrain's GPT and Llama (both `StagedLM`s: their forward is their stages in a row), and
the Hugging Face causal LMs dtrain wraps (dtrain.models.hf), all implement it; a user's
own module (`arch = "custom"`) does too to be pipelined.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol, TypedDict, cast, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.context_parallel import ContextParallel, positions_of
from dtrain.errors import ConfigError, DtrainError
from dtrain.masks import compiled_flex_attention, document_mask
from dtrain.models.chunked_loss import chunked_loss
from dtrain.models.kv_cache import KVCache, LayerCache
from dtrain.models.rows import PackedDocuments, weighted


# torch 2.5 and later attend grouped queries to their key/value head without copies.
class _GQA(TypedDict, total=False):
    """SDPA's grouped-query flag, passed only where torch has it (2.5 on)."""

    enable_gqa: bool


_SDPA_GQA = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)


@runtime_checkable
class Stages(Protocol):
    """A model the pipeline can cut by its blocks."""

    def stage_parts(self) -> tuple[list[str], str, list[str]]:
        """(the modules the first stage runs before the blocks, the name of the blocks'
        nn.ModuleList, the modules the last stage runs after them), as dotted names."""

    def stage_in(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, time) -> the first block's input."""

    def stage_block(self, block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """One block applied to hidden states (recomputing whatever per-position inputs it
        needs, such as rotary embeddings, from `h`'s shape)."""

    def stage_out(self, h: torch.Tensor) -> torch.Tensor:
        """The last block's output -> logits."""


class StagedLM(nn.Module):
    """A language model whose forward is its stages in a row: `stage_in`, every block of
    `stage_parts()`, `stage_out` (`output_head()` on `final_hidden`), then with targets the
    loss of `self.loss_fn` (a module, so tensor parallelism can swap it for a
    vocab-parallel one): of the logits, or with `loss_chunk` set of the final hidden
    states chunk by chunk (dtrain.models.chunked_loss). Subclasses set `block_size` (the
    longest input), `stage_parts`, `stage_in`, `final_hidden` and `output_head`."""

    block_size: int
    loss_fn: nn.Module
    # the stage methods (stage_block and stage_out have defaults below), which the
    # subclasses define
    stage_parts: Callable[[], tuple[list[str], str, list[str]]]
    stage_in: Callable[[torch.Tensor], torch.Tensor]
    final_hidden: Callable[[torch.Tensor], torch.Tensor]
    output_head: Callable[[], nn.Module]
    loss_chunk: int = 0
    """Tokens per chunk of the training loss (dtrain.models.chunked_loss.apply sets it);
    0: the plain loss, of every token's logits at once."""
    context: ContextParallel | None = None
    """Context parallelism (dtrain.models.context.apply): the inputs are this rank's chunks
    of each sequence, whose positions are the global ones."""
    kv_cache: KVCache | None = None
    """Generation's cache (dtrain.models.generate.attach): the inputs are the tokens after
    the `kv_cache.length` it holds, whose positions start there."""
    documents: PackedDocuments | None = None
    """The last forward's packed documents (their positions and mask), which the blocks
    pass to their attention; None: one sequence per row (dtrain.models.rows)."""
    documents_given: int = 0
    """How many forwards were given documents: what a cache of per-position values
    (Llama's rotary angles) keys on, as the rows change with every one."""

    def positions(self, t: int, device: torch.device) -> torch.Tensor:
        """The positions of the `t` tokens the blocks see (dtrain.context_parallel.
        positions_of), after those a KV cache holds; of packed documents, their own
        places (batch, time)."""
        if self.documents is not None:
            return self.documents.positions
        at = positions_of(self.context, t, device)
        return at if self.kv_cache is None else at + self.kv_cache.length

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None,
        positions: torch.Tensor | None = None, weight: float | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor | None, torch.Tensor]:
        """Logits of `idx` (batch, time), or (logits, loss) with `targets`; under the
        chunked loss (`loss_chunk`) (None, loss), as no logits of every token exist.

        Args:
            positions: rows of packed documents: each token's place in its document
                (attention stays inside each; dtrain.models.rows).
            weight: the loss's share of the step's (dtrain.data.sequences.Batch.weight):
                the model's own loss is the mean over its targets times it.

        Raises:
            ValueError: a longer sequence than block_size.
            DtrainError: documents with a KV cache.
        """
        if idx.shape[1] > self.block_size:
            raise ValueError(f"sequence of {idx.shape[1]} tokens exceeds "
                             f"block_size={self.block_size}")
        self.use_documents(positions)
        x = self.stage_in(idx)
        for block in cast(nn.ModuleList, self.get_submodule(self.stage_parts()[1])):
            x = self.stage_block(block, x)
        if targets is None:
            return self.stage_out(x)
        logits, loss = self.head_loss(self.final_hidden(x), targets, weight)
        # before extra_loss: the predictions ahead run blocks of their own (MoE ones too)
        for more in (self.ahead_loss(idx, x, targets, weight), self.extra_loss()):
            if more is not None:
                loss = loss + more
        return logits, loss

    def head_loss(self, final: torch.Tensor, targets: torch.Tensor, weight: float | None
                  ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(logits, loss) of final hidden states (after `final_hidden`) against `targets`
        through `output_head()` and `loss_fn`, the loss weighed by `weight` (`weighted`);
        under the chunked loss (None, loss), with no logits of every token at once."""
        if self.loss_chunk:
            loss = chunked_loss(self, final, targets)
            # finite without targets (0), so it carries its own zero where the weight is 0
            return None, weighted(loss, weight, loss)
        logits = self.output_head()(final)
        loss = self.loss_fn(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, weighted(loss, weight, logits)

    def use_documents(self, positions: torch.Tensor | None) -> None:
        """Make the next stages' forwards run rows of packed documents at `positions`
        (None: one sequence per row); forward calls it, a pipeline stage too.

        Raises:
            DtrainError: documents with a KV cache (generation runs one sequence).
        """
        self.documents = PackedDocuments.given(positions, self.context is not None,
                                               self.kv_cache is not None, flex=True)
        self.documents_given += positions is not None

    def stage_block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return block(x)

    def stage_out(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_head()(self.final_hidden(x))

    def extra_loss(self) -> torch.Tensor | None:
        """A loss the blocks computed on the way, added to the model's (a mixture of
        experts' load balancing); None by default."""
        return None

    @property
    def predicts_ahead(self) -> bool:
        """Whether `ahead_loss` adds a loss (multi-token prediction's modules): a pipeline
        then gives its last stage the micro-batches' token ids too (dtrain.pipeline.Piece).
        False by default."""
        return False

    def ahead_loss(self, idx: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor,
                   weight: float | None) -> torch.Tensor | None:
        """A loss of predictions further ahead than the next token, from the last block's
        output `hidden` and the forward's `idx` and `targets` (multi-token prediction,
        dtrain.models.mtp), added to the model's; None by default."""
        return None


class Activation(nn.Module):
    """An activation function worth recomputing: elementwise (cheap to run again) on the
    MLP's widest tensors (large to keep). Selective recomputation
    (dtrain.models.recompute) recomputes every one, as it does every AttentionCore."""


class AttentionCore(nn.Module):
    """Causal attention of (batch, heads, time, head size) queries, keys and values:
    softmax(q k^T / sqrt(d)) v with dropout on the probabilities while training. A module of
    its own (no parameters) so activation checkpointing can recompute just it ("selective",
    dtrain.models.recompute). Fewer key/value heads than query heads are grouped-query
    attention: query head i reads key/value head i // (heads / kv heads)."""

    context: ContextParallel | None = None
    """Context parallelism: q, k and v are this rank's chunks of the sequence, and the
    keys and values of the others are met through it (dtrain.context_parallel)."""
    cache: LayerCache | None = None
    """Generation's cache of this core's keys and values (dtrain.models.kv_cache): q, k
    and v are the new tokens', which attend to every token kept before them too."""

    rng: Callable[[torch.device], AbstractContextManager[None]] | None = None
    """Where to draw the dropout mask: inside `rng(device)` when set (each tensor-parallel
    rank holds its own heads and draws its own masks: dtrain.tensor_parallel.rng), the
    default generator otherwise."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: PackedDocuments | None = None, before: int = 0) -> torch.Tensor:
        """Attention of q to k and v, causal, or inside each of the rows' packed
        `documents` (dtrain.models.rows). Values may be narrower or wider than queries and
        keys (multi-head latent attention's are); the scale is 1 / sqrt(q's head size).

        Args:
            before: how many of k's and v's tokens come before q's first, read from a cache
                kept outside the core (multi-head latent attention's compressed one,
                dtrain.models.mla); the core's own `cache` counts its own."""
        drop = self.dropout if self.training else 0.0
        if self.context is not None:
            if drop:
                raise DtrainError("attention dropout under context parallelism: set the "
                                  "model's dropout to 0")
            return self.context.attention(
                q, k, v, documents=None if documents is None else documents.positions)
        mask: torch.Tensor | None = None
        if documents is not None and isinstance(documents.mask, torch.Tensor):
            mask = documents.mask
        elif documents is not None and documents.mask is not None:
            # flex attention's BlockMask (CUDA): the blocks no query sees are skipped
            if not drop:
                return compiled_flex_attention()(q, k, v, block_mask=documents.mask,
                                                 enable_gqa=q.shape[1] != k.shape[1])
            mask = document_mask(documents.positions)  # flex attention has no dropout
        if self.cache is not None:
            k, v, before = self.cache.extend(k, v)
        group = q.shape[1] // k.shape[1]
        if group > 1 and not _SDPA_GQA:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        gqa: _GQA = {"enable_gqa": True} if group > 1 and _SDPA_GQA else {}
        if before == 0:
            with self._dropout_rng(drop, q.device):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=drop,
                                                      is_causal=mask is None, attn_mask=mask,
                                                      **gqa)
        # New token i sits at position before + i: it sees every key up to there (SDPA's
        # is_causal would align the queries with the first keys instead).
        t = q.shape[2]
        seen = (torch.arange(k.shape[2], device=q.device)[None, :]
                <= before + torch.arange(t, device=q.device)[:, None])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=None if t == 1 else seen,
                                              dropout_p=drop, **gqa)

    def _dropout_rng(self, drop: float, device: torch.device
                     ) -> AbstractContextManager[None]:
        """Where this call draws its dropout mask: `rng(device)`, or the default generator
        (no dropout, or no rng set)."""
        if drop and self.rng is not None:
            return self.rng(device)
        return nullcontext()


def block_lists(model: nn.Module, asked: tuple[str, str]) -> list[str]:
    """The names of the nn.ModuleLists holding `model`'s transformer blocks: the one
    `model.stage_parts()` names for a `Stages` model, else every non-empty nn.ModuleList.
    `asked` is (what needs the blocks, what to do instead) for the error.

    Raises:
        ConfigError: the model keeps no blocks in an nn.ModuleList.
    """
    if isinstance(model, Stages):
        try:
            return [model.stage_parts()[1]]
        except ConfigError:  # a model the pipeline cannot cut: its lists, as any model's
            pass
    lists = [name for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) and name]
    if not lists:
        what, instead = asked
        raise ConfigError(f"{what}: {type(model).__name__} keeps no blocks in an "
                          f"nn.ModuleList: {instead}")
    return lists
