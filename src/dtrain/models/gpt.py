"""A small GPT (decoder-only transformer), byte-level by default.

The same architecture as GPT-2 (pre-norm blocks of causal self-attention and an MLP,
learned positions, tied input/output embeddings), kept small enough to train on a few CPU
cores. The demo, the tests and the benchmarks use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.models.chunked_loss import CrossEntropy
from dtrain.models.rows import PackedDocuments
from dtrain.models.stages import AttentionCore, StagedLM


@dataclass
class GPTConfig:
    """Shape of the model; the `[model]` section of `dtrain train`'s config."""

    vocab_size: int = 256
    """Number of token ids; 256 covers every byte."""
    block_size: int = 128
    """Longest context, in tokens."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability; 0 keeps runs reproducible."""


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.core = AttentionCore(cfg.dropout)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor, documents: PackedDocuments | None = None
                ) -> torch.Tensor:
        # Heads and time from qkv's output: under tensor parallelism a rank holds only its
        # own heads (Q, K and V split by heads), and under sequence parallelism x is this
        # rank's part of the sequence, which qkv gathers whole.
        qkv = self.qkv(x)
        b, t = qkv.shape[:2]
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2)
                   for z in qkv.chunk(3, dim=2))
        return self.proj(self.core(q, k, v, documents).transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, documents: PackedDocuments | None = None
                ) -> torch.Tensor:
        """`documents`: the rows' packed documents (dtrain.models.rows)."""
        x = x + self.attn(self.ln1(x), documents)
        return x + self.mlp(self.ln2(x))


class GPT(StagedLM):
    """Decoder-only transformer returning logits, or (logits, loss) given targets ((None,
    loss) under the chunked loss: dtrain.models.chunked_loss)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_head={cfg.n_head} does not divide n_embd={cfg.n_embd}")
        self.cfg, self.block_size = cfg, cfg.block_size
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied embeddings, as in GPT-2
        self.loss_fn = CrossEntropy()  # a module, so tensor parallelism can swap it
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    # How the pipeline cuts it (dtrain.models.Stages).
    def stage_parts(self) -> tuple[list[str], str, list[str]]:
        return ["wte", "wpe", "drop"], "blocks", ["ln_f", "head"]

    def stage_in(self, idx: torch.Tensor) -> torch.Tensor:
        pos = self.positions(idx.shape[1], idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))

    def stage_block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return block(x, self.documents)

    def final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_f(x)

    def output_head(self) -> nn.Module:
        return self.head
