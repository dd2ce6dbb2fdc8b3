"""dtrain's Llama: RMSNorm, rotary positions, grouped-query attention, a SwiGLU MLP.

The architecture of Meta's Llama 2 and 3 as Hugging Face's `LlamaForCausalLM` computes it
(no biases, pre-norm blocks, rotary embeddings in the rotate-half convention), so its
weights map one to one onto that model's (dtrain.models.convert) and its logits agree to
float rounding. `PRESETS` names the published shapes, and a tiny one for tests and demos.

    model = Llama(llama_config(resolve(ModelConfig(arch="llama", preset="llama-tiny"), 256)))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.errors import ConfigError
from dtrain.models.chunked_loss import CrossEntropy
from dtrain.models.config import ModelConfig, moe_layer_indices
from dtrain.models.moe import Experts, MoE, MoEConfig, Router, aux_loss
from dtrain.models.rows import PackedDocuments
from dtrain.models.stages import Activation, AttentionCore, StagedLM

_LLAMA_3 = {"vocab_size": 128256, "rope_theta": 500000.0, "norm_eps": 1e-5}
_QWEN3 = {"vocab_size": 151936, "rope_theta": 1000000.0, "norm_eps": 1e-6, "head_dim": 128,
          "qk_norm": True, "n_kv_head": 4, "n_experts": 128, "experts_per_token": 8,
          "block_size": 40960, "tie_embeddings": False, "norm_topk_prob": True}
PRESETS: dict[str, tuple[str, dict]] = {
    "llama-tiny": ("llama", {"n_layer": 4, "n_embd": 128, "n_head": 4, "n_kv_head": 2,
                             "ffn_hidden": 352, "vocab_size": 0, "block_size": 128,
                             "tie_embeddings": False, "rope_theta": 10000.0,
                             "norm_eps": 1e-5}),
    "llama-3.2-1b": ("llama", {**_LLAMA_3, "n_layer": 16, "n_embd": 2048, "n_head": 32,
                               "n_kv_head": 8, "ffn_hidden": 8192, "block_size": 131072,
                               "tie_embeddings": True}),
    "llama-3-8b": ("llama", {**_LLAMA_3, "n_layer": 32, "n_embd": 4096, "n_head": 32,
                             "n_kv_head": 8, "ffn_hidden": 14336, "block_size": 8192,
                             "tie_embeddings": False}),
    "llama-3-70b": ("llama", {**_LLAMA_3, "n_layer": 80, "n_embd": 8192, "n_head": 64,
                              "n_kv_head": 8, "ffn_hidden": 28672, "block_size": 8192,
                              "tie_embeddings": False}),
    "moe-tiny": ("llama", {"n_layer": 4, "n_embd": 128, "n_head": 4, "n_kv_head": 2,
                           "ffn_hidden": 352, "vocab_size": 0, "block_size": 128,
                           "tie_embeddings": False, "rope_theta": 10000.0, "norm_eps": 1e-5,
                           "n_experts": 8, "experts_per_token": 2, "moe_inter_size": 128}),
    "mixtral-8x7b": ("llama", {"vocab_size": 32000, "n_layer": 32, "n_embd": 4096,
                               "n_head": 32, "n_kv_head": 8, "ffn_hidden": 14336,
                               "block_size": 32768, "rope_theta": 1000000.0,
                               "norm_eps": 1e-5, "tie_embeddings": False, "n_experts": 8,
                               "experts_per_token": 2}),
    "qwen3-30b-a3b": ("llama", {**_QWEN3, "n_layer": 48, "n_embd": 2048, "n_head": 32,
                                "ffn_hidden": 6144, "moe_inter_size": 768}),
    "qwen3-235b-a22b": ("llama", {**_QWEN3, "n_layer": 94, "n_embd": 4096, "n_head": 64,
                                  "ffn_hidden": 12288, "moe_inter_size": 1536}),
}
"""Named shapes: preset -> ("llama", ModelConfig shape keys). Llama 3.2's published model
also scales its rotary frequencies for long contexts ("llama3" rope scaling), which dtrain's
Llama does not: the shape is the same, the positions past 8192 are not."""


@dataclass
class LlamaConfig:
    """Shape of dtrain's Llama (from the `[model]` section by `llama_config`).

    Raises:
        ConfigError: on construction, heads that do not divide the width or each other, or
            an odd head size.
    """

    vocab_size: int = 256
    """Number of token ids."""
    block_size: int = 128
    """Longest context, in tokens."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Query heads per block; must divide n_embd, into an even head size."""
    n_kv_head: int = 2
    """Key/value heads (grouped-query attention); must divide n_head."""
    n_embd: int = 128
    """Width of the residual stream."""
    ffn_hidden: int = 352
    """Hidden width of the SwiGLU MLP."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding's frequencies."""
    norm_eps: float = 1e-5
    """RMSNorm's epsilon."""
    tie_embeddings: bool = False
    """The output head shares the token embedding's weight."""
    dropout: float = 0.0
    """Dropout on the attention probabilities (Hugging Face's attention_dropout)."""
    head_dim: int = 0
    """Width of each attention head; 0 means n_embd / n_head (Qwen3 sets its own)."""
    qk_norm: bool = False
    """RMSNorm each query and key head before the rotary embedding (Qwen3)."""
    moe: MoEConfig | None = None
    """The mixture-of-experts MLP of the blocks in `moe_layers` (None: every block dense)."""
    moe_layers: tuple[int, ...] = ()
    """The blocks whose MLP is `moe` (the others keep the dense SwiGLU)."""

    @property
    def head_size(self) -> int:
        """Each attention head's width."""
        return self.head_dim or self.n_embd // self.n_head

    def __post_init__(self) -> None:
        if self.n_head <= 0 or (self.n_embd % self.n_head and not self.head_dim):
            raise ConfigError(f"model.n_head = {self.n_head} does not divide model.n_embd = "
                              f"{self.n_embd}: choose a head count that divides it")
        if self.n_kv_head <= 0 or self.n_head % self.n_kv_head:
            raise ConfigError(f"model.n_kv_head = {self.n_kv_head} does not divide model.n_head"
                              f" = {self.n_head}: choose a key/value head count that divides it")
        if self.head_size % 2:
            what = "model.head_dim" if self.head_dim else "model.n_embd / model.n_head"
            raise ConfigError(f"{what} = {self.head_size} is odd: rotary embeddings need an "
                              "even head size")


def llama_ffn_hidden(n_embd: int) -> int:
    """Llama's MLP width for `n_embd`: 8/3 of it, rounded up to a multiple of 256."""
    return math.ceil(int(2 * 4 * n_embd / 3) / 256) * 256


def llama_config(cfg: ModelConfig) -> LlamaConfig:
    """The LlamaConfig of a resolved `[model]` section (presets applied, vocabulary set):
    n_kv_head 0 means n_head, ffn_hidden 0 Llama's rule (`llama_ffn_hidden`).

    Raises:
        ConfigError: the heads do not divide the width or each other, or the head size is odd.
    """
    ffn_hidden = cfg.ffn_hidden or llama_ffn_hidden(cfg.n_embd)
    moe = moe_config(cfg)
    return LlamaConfig(vocab_size=cfg.vocab_size, block_size=cfg.block_size,
                       n_layer=cfg.n_layer, n_head=cfg.n_head,
                       n_kv_head=cfg.n_kv_head or cfg.n_head, n_embd=cfg.n_embd,
                       ffn_hidden=ffn_hidden, rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps,
                       tie_embeddings=cfg.tie_embeddings, dropout=cfg.dropout,
                       head_dim=cfg.head_dim, qk_norm=cfg.qk_norm, moe=moe,
                       moe_layers=moe_layer_indices(cfg.moe_layers, cfg.n_layer)
                       if moe is not None else ())


def moe_config(cfg: ModelConfig) -> MoEConfig | None:
    """The MoE blocks' shape and rules of a `[model]` section (None: every block dense);
    moe_inter_size 0 means the dense MLP's width.

    Raises:
        ConfigError: a rule out of range (MoEConfig's checks).
    """
    if not cfg.n_experts:
        return None
    return MoEConfig(
        n_experts=cfg.n_experts, experts_per_token=cfg.experts_per_token,
        hidden=cfg.moe_inter_size or cfg.ffn_hidden or llama_ffn_hidden(cfg.n_embd),
        n_shared_experts=cfg.n_shared_experts, router=cfg.router,
        norm_topk_prob=cfg.norm_topk_prob, aux_loss_weight=cfg.aux_loss_weight,
        capacity_factor=cfg.capacity_factor)


def parameter_count(cfg: LlamaConfig, active: bool = False) -> int:
    """Parameters of `Llama(cfg)` (a tied head counted once), without building it; with
    `active`, those one token uses: of each MoE layer's routed experts only the k it goes
    to (the router, its bias included, and the shared experts count in both)."""
    head_dim = cfg.head_size
    attention = 2 * cfg.n_embd * cfg.n_head * head_dim + 2 * cfg.n_embd * cfg.n_kv_head * head_dim
    attention += 2 * head_dim if cfg.qk_norm else 0
    dense = 3 * cfg.n_embd * cfg.ffn_hidden
    total = 0
    for i in range(cfg.n_layer):
        mlp = dense
        if cfg.moe is not None and i in cfg.moe_layers:
            m = cfg.moe
            used = m.experts_per_token if active else m.n_experts
            mlp = (m.n_experts * (cfg.n_embd + 1) + used * 3 * cfg.n_embd * m.hidden
                   + m.n_shared_experts * 3 * cfg.n_embd * m.hidden)
        total += attention + mlp + 2 * cfg.n_embd
    embeddings = cfg.vocab_size * cfg.n_embd * (1 if cfg.tie_embeddings else 2)
    return embeddings + total + cfg.n_embd


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back, as Hugging Face's Llama."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotary(t: int, head_dim: int, theta: float, device: torch.device,
           dtype: torch.dtype, positions: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of positions 0..t-1 (or the `t` given `positions`), each (t, head_dim):
    the frequencies repeated across the two halves of a head, as Hugging Face's
    rotate-half convention pairs them."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    at = torch.arange(t, device=device) if positions is None else positions
    freqs = at.float()[:, None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_size
        self.theta = cfg.rope_theta
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        if cfg.qk_norm:  # Qwen3: each head normalized before the rotation
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        self.qk_norm = cfg.qk_norm
        self.core = AttentionCore(cfg.dropout)
        self.o_proj = nn.Linear(cfg.n_head * self.head_dim, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                documents: PackedDocuments | None = None) -> torch.Tensor:
        """`rope`: the (cos, sin) of x's positions, computed once per forward by the model
        (computed here when not given); `documents`: the rows' packed documents
        (dtrain.models.rows)."""
        # Head counts and time from the projections' outputs: under tensor parallelism a rank
        # holds only its own query and key/value heads (dtrain.tensor_parallel.llama_plan),
        # and under sequence parallelism x is this rank's part of the sequence, which the
        # projections gather whole.
        q, k, v = (proj(x) for proj in (self.q_proj, self.k_proj, self.v_proj))
        b, t = q.shape[:2]
        q, k, v = (z.view(b, t, -1, self.head_dim) for z in (q, k, v))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        cos, sin = rope if rope is not None else rotary(t, self.head_dim, self.theta,
                                                        x.device, q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return self.o_proj(self.core(q, k, v, documents).transpose(1, 2).reshape(b, t, -1))


class SwiGLU(Activation):
    """silu(gate) * up. Autograd keeps gate, up and silu(gate) for its backward (the
    product, down's input, is kept by down); recomputed, it keeps gate and up only."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.up = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.act = SwiGLU()
        self.down = nn.Linear(cfg.ffn_hidden, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x), self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, moe: bool = False) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = MoE(cfg.moe, cfg.n_embd) if moe and cfg.moe is not None else MLP(cfg)

    def forward(self, x: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                documents: PackedDocuments | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, documents)
        return x + self.mlp(self.mlp_norm(x))


class Llama(StagedLM):
    """Llama returning logits, or (logits, loss) given targets ((None, loss) under the
    chunked loss: dtrain.models.chunked_loss); its LlamaConfig has checked the shape."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg, self.block_size = cfg, cfg.block_size
        self.embed = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, i in cfg.moe_layers) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self.loss_fn = CrossEntropy()  # a module, so tensor parallelism can swap it
        self._rope_cache: tuple = (None, None)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        # Hugging Face's initializer_range = 0.02; RMSNorm weights start at ones.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, (Experts, Router)):
            module.reset_parameters(0.02)

    def extra_loss(self) -> torch.Tensor | None:
        """The weighted load-balancing loss of the MoE blocks in the last forward."""
        return aux_loss(self) if self.cfg.moe is not None else None

    # How the pipeline cuts it (dtrain.models.Stages).
    def stage_parts(self) -> tuple[list[str], str, list[str]]:
        return ["embed"], "blocks", ["norm", "head"]

    def stage_in(self, idx: torch.Tensor) -> torch.Tensor:
        return self.embed(idx)

    def stage_block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return block(x, self._rope(x), self.documents)

    def final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    def output_head(self) -> nn.Module:
        return self.head

    sequence_parts: int = 1
    """How many parts the blocks' input is of the whole sequence: tp under sequence
    parallelism (set by dtrain.tensor_parallel.apply_sequence_parallel), where each rank's
    blocks see their part and attention gathers the whole."""

    def _rope(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary (cos, sin) of the whole sequence's positions (x holds 1 /
        `sequence_parts` of it; under context parallelism, of this rank's chunks), kept for
        the blocks that follow (every block of a forward shares them)."""
        t = x.shape[1] * self.sequence_parts
        offset = self.kv_cache.length if self.kv_cache is not None else 0
        key = (t, x.device, x.dtype, type(x), id(self.context), offset,  # fake: not real
               self.documents is not None and self.documents_given)
        if self._rope_cache[0] != key:
            head_dim = self.cfg.head_size
            cos, sin = rotary(t, head_dim, self.cfg.rope_theta, x.device, x.dtype,
                              self.positions(t, x.device).reshape(-1))
            if self.documents is not None:  # each row its own positions: (batch, 1, t, d)
                cos, sin = (z.view(-1, 1, t, head_dim) for z in (cos, sin))
            self._rope_cache = (key, (cos, sin))
        return self._rope_cache[1]
