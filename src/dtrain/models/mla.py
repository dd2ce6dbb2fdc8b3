"""Multi-head latent attention (MLA): DeepSeek-V2's and V3's attention, whose keys and
values are decompressed from one small latent per token.

    attn = LatentAttention(dim=7168, n_head=128, cfg=MLAConfig(kv_lora_rank=512,
                           qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                           q_lora_rank=1536), theta=10000.0)

For each token x (width dim), `n_head` heads:

- Queries: W_qb RMSNorm(W_qa x) through a rank-`q_lora_rank` bottleneck (DeepSeek-V3), or
  W_q x when q_lora_rank = 0 (DeepSeek-V2-Lite); each head's query is a part without
  position (`qk_nope_head_dim`) and a rotary part (`qk_rope_head_dim`).
- Keys and values: one projection W_kva x gives the latent c (`kv_lora_rank` numbers,
  RMSNorm-ed) and a rotary key part k_rope that every head shares. Each head's key is
  [its rows of W_kb c, k_rope] and its value its rows of W_vb c (`kv_b_proj` holds both,
  per head qk_nope_head_dim key rows then v_head_dim value rows). The rotary part is
  decoupled from the latent because a rotation between W_kb and the query would stop W_kb
  from being folded into the query at inference, DeepSeek-V2's reason for it.
- Attention: softmax(q k^T / sqrt(qk_nope_head_dim + qk_rope_head_dim)) v per head
  through dtrain's AttentionCore (causal, or inside packed documents; selective
  recomputation recomputes it), then `o_proj` from n_head x v_head_dim. Values are
  `v_head_dim` wide, queries and keys nope + rope: the core takes both widths.

The rotary dimensions rotate in interleaved pairs (0, 1), (2, 3), ..., the layout of
DeepSeek's published weights (transformers' `rope_interleave = true`): they are
de-interleaved (evens, then odds) and turned by Llama's rotate-half, the same rotation.
The module and parameter names are transformers' `DeepseekV3Attention`'s, so weights map
by name, and the latent norms keep its fixed epsilon (1e-6).

Generation keeps the normalized latent and the rotated k_rope per token
(dtrain.models.kv_cache.LatentCache: kv_lora_rank + qk_rope_head_dim numbers, whatever
the head count) and decompresses every kept token's keys and values at each step; DeepSeek's
inference trick of folding W_kb into the queries and W_vb into o_proj, which skips the
decompression, is not done.

Not here: yarn rope scaling (DeepSeek-V3's long-context extension, which changes the
frequencies and the softmax scale): dtrain's Llama refuses a folder that asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dtrain.errors import ConfigError
from dtrain.models.kv_cache import LatentCache
from dtrain.models.llama_parts import RMSNorm, rotary, rotate
from dtrain.models.rows import PackedDocuments
from dtrain.models.stages import AttentionCore

LATENT_NORM_EPS = 1e-6
"""The epsilon of the latents' RMSNorms: fixed in DeepSeek's and transformers' code, not
the model's rms_norm_eps."""


@dataclass(frozen=True)
class MLAConfig:
    """The shape of multi-head latent attention (the `[model]` keys of the same names).

    Raises:
        ConfigError: on construction, a latent or head width that is not positive, or an
            odd rotary part.
    """

    kv_lora_rank: int
    """Width of the latent keys and values are decompressed from (what a cache keeps)."""
    qk_rope_head_dim: int
    """Width of each query's and the shared key's rotary part; even."""
    qk_nope_head_dim: int
    """Width of each head's query and key part without positions."""
    v_head_dim: int
    """Width of each head's value."""
    q_lora_rank: int = 0
    """Width of the queries' bottleneck; 0: one plain query projection."""

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.attention = \"mla\" needs model.{name} above 0 (it "
                                  f"is {getattr(self, name)}): set it")
        if self.qk_nope_head_dim < 0 or self.q_lora_rank < 0:
            raise ConfigError("model.qk_nope_head_dim and model.q_lora_rank must not be "
                              "negative")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"model.qk_rope_head_dim = {self.qk_rope_head_dim} is odd: "
                              "rotary embeddings turn pairs, make it even")

    @property
    def qk_head_dim(self) -> int:
        """Each head's query and key width: the part without positions and the rotary one."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cached_per_token(self) -> int:
        """Numbers a cache keeps per token and layer: the latent and the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """The last dimension's even elements, then its odd ones: DeepSeek's interleaved rotary
    pairs (0, 1), (2, 3), ... laid out as rotate-half pairs them (i, i + d/2)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentAttention(nn.Module):
    """Multi-head latent attention: (batch, time, dim) -> (batch, time, dim).

    Args:
        dim: the residual stream's width.
        n_head: query heads (each with its own decompressed key and value).
        cfg: the latent and head widths.
        theta: the rotary frequencies' base (used when the caller gives no angles).
        dropout: on the attention probabilities while training.
    """

    def __init__(self, dim: int, n_head: int, cfg: MLAConfig, theta: float = 10000.0,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.cfg, self.theta = cfg, theta
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(dim, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, n_head * cfg.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(dim, n_head * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, cfg.cached_per_token, bias=False)
        self.share_rope = nn.Identity()
        """Hands the rotary key part every head reads to the heads: itself here; under
        tensor parallelism (dtrain.tensor_parallel.latent_attention_plan) a layer that
        sums its gradient over the tp ranks' heads and, under sequence parallelism, gathers
        the sequence. The latents need none: q_b_proj and kv_b_proj, split by heads, do
        it."""
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank,
                                   n_head * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.core = AttentionCore(dropout)
        self.o_proj = nn.Linear(n_head * cfg.v_head_dim, dim, bias=False)
        self.cache: LatentCache | None = None
        """Generation's cache of this attention's latents (dtrain.models.generate puts it
        here, not on the core: what it keeps is compressed)."""

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """x's queries, (batch, heads, time, qk_head_dim), before the rotation."""
        if self.cfg.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        # time from q: under sequence parallelism x is this rank's part, q_b_proj gathers
        return q.view(*q.shape[:2], -1, self.cfg.qk_head_dim).transpose(1, 2)

    def compress(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x's normalized latents (batch, time, kv_lora_rank) and its shared rotary key
        parts (batch, 1, time, qk_rope_head_dim), before the rotation."""
        latent, k_rope = self.kv_a_proj_with_mqa(x).split(
            [self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim], dim=-1)
        return self.kv_a_layernorm(latent), self.share_rope(k_rope).unsqueeze(1)

    def decompress(self, latent: torch.Tensor, k_rope: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's keys (batch, heads, time, qk_head_dim) and values (batch, heads,
        time, v_head_dim) from the latents and the rotated shared key parts."""
        cfg = self.cfg
        kv = self.kv_b_proj(latent)
        kv = kv.view(*kv.shape[:2], -1, cfg.qk_nope_head_dim + cfg.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        return k, v

    def forward(self, x: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                documents: PackedDocuments | None = None) -> torch.Tensor:
        """`rope`: the (cos, sin) of x's positions over qk_rope_head_dim, computed once per
        forward by the model (here when not given); `documents`: the rows' packed documents
        (dtrain.models.rows)."""
        q_nope, q_rope = self.queries(x).split(
            [self.cfg.qk_nope_head_dim, self.cfg.qk_rope_head_dim], dim=-1)
        b, t = q_nope.shape[0], q_nope.shape[2]  # the whole sequence under tp's parts
        latent, k_rope = self.compress(x)
        cos, sin = rope if rope is not None else rotary(t, self.cfg.qk_rope_head_dim,
                                                        self.theta, x.device, x.dtype)
        q_rope = rotate(deinterleave(q_rope), cos, sin)
        k_rope = rotate(deinterleave(k_rope), cos, sin)
        before = 0
        if self.cache is not None:  # kept compressed, decompressed whole at every step
            latent, k_rope, before = self.cache.extend(latent, k_rope)
        k, v = self.decompress(latent, k_rope)
        out = self.core(torch.cat((q_nope, q_rope), dim=-1), k, v, documents, before=before)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
