"""dtrain's Llama: RMSNorm, rotary positions, grouped-query attention, a SwiGLU MLP.

The architecture of Meta's Llama 2 and 3 as Hugging Face's `LlamaForCausalLM` computes it
(no biases, pre-norm blocks, rotary embeddings in the rotate-half convention), so its
weights map one to one onto that model's (dtrain.models.convert) and its logits agree to
float rounding. `PRESETS` names the published shapes, and a tiny one for tests and demos.

    model = Llama(llama_config(resolve(ModelConfig(arch="llama", preset="llama-tiny"), 256)))

The same family holds the mixture-of-experts models (Mixtral, Qwen3-MoE: dtrain.models.moe)
and DeepSeek-V3's architecture: multi-head latent attention in place of grouped-query
attention (dtrain.models.mla), dense first blocks then MoE blocks with a shared expert and
a grouped sigmoid router, and multi-token prediction modules after the last block
(dtrain.models.mtp); the `deepseek-v3` and `kimi-k2` presets are those published shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.errors import ConfigError
from dtrain.models.chunked_loss import CrossEntropy
from dtrain.models.config import ModelConfig, check_attention, moe_layer_indices
from dtrain.models.llama_parts import RMSNorm, rotary, rotate
from dtrain.models.mla import LatentAttention, MLAConfig
from dtrain.models.moe import Experts, MoE, MoEConfig, Router, aux_loss
from dtrain.models.moe.router import check_groups
from dtrain.models.mtp import MultiTokenPrediction
from dtrain.models.rows import PackedDocuments
from dtrain.models.stages import Activation, AttentionCore, StagedLM

_LLAMA_3 = {"vocab_size": 128256, "rope_theta": 500000.0, "norm_eps": 1e-5}
_QWEN3 = {"vocab_size": 151936, "rope_theta": 1000000.0, "norm_eps": 1e-6, "head_dim": 128,
          "qk_norm": True, "n_kv_head": 4, "n_experts": 128, "experts_per_token": 8,
          "block_size": 40960, "tie_embeddings": False, "norm_topk_prob": True}
_DEEPSEEK_V3 = {"n_layer": 61, "n_embd": 7168, "ffn_hidden": 18432, "block_size": 4096,
                "norm_eps": 1e-6, "tie_embeddings": False, "attention": "mla",
                "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                "qk_rope_head_dim": 64, "v_head_dim": 128, "experts_per_token": 8,
                "n_shared_experts": 1, "moe_inter_size": 2048, "router": "sigmoid_bias",
                "norm_topk_prob": True}
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
    "deepseek-tiny": ("llama", {"n_layer": 3, "n_embd": 128, "n_head": 4, "ffn_hidden": 352,
                                "vocab_size": 0, "block_size": 128, "tie_embeddings": False,
                                "rope_theta": 10000.0, "norm_eps": 1e-6, "attention": "mla",
                                "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 32,
                                "qk_rope_head_dim": 16, "v_head_dim": 32, "n_experts": 8,
                                "experts_per_token": 2, "n_shared_experts": 1,
                                "moe_inter_size": 64, "moe_layers": "after 1",
                                "router": "sigmoid_bias", "n_group": 4, "topk_group": 2,
                                "routed_scaling_factor": 2.5, "mtp_depth": 1}),
    "deepseek-v3": ("llama", {**_DEEPSEEK_V3, "vocab_size": 129280, "n_head": 128,
                              "rope_theta": 10000.0, "n_experts": 256, "moe_layers": "after 3",
                              "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
                              "mtp_depth": 1}),
    "kimi-k2": ("llama", {**_DEEPSEEK_V3, "vocab_size": 163840, "n_head": 64,
                          "rope_theta": 50000.0, "n_experts": 384, "moe_layers": "after 1",
                          "routed_scaling_factor": 2.827}),
}
"""Named shapes: preset -> ("llama", ModelConfig shape keys). Llama 3.2's published model
also scales its rotary frequencies for long contexts ("llama3" rope scaling), which dtrain's
Llama does not: the shape is the same, the positions past 8192 are not.

`deepseek-v3` is DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3) and `kimi-k2` Kimi
K2's (moonshotai/Kimi-K2-Instruct, a DeepSeek-V3 shape with 384 experts, 64 heads, one
dense block, one expert group, no MTP module), both at their pretraining context of 4096
tokens: their longer contexts come from yarn rope scaling, which dtrain's Llama does not
do."""


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
    routed_scaling_factor: float = 1.0
    """What the MoE routers' weights are multiplied by (DeepSeek-V3: 2.5)."""
    mla: MLAConfig | None = None
    """Multi-head latent attention's widths (None: grouped-query attention)."""
    mtp_depth: int = 0
    """Multi-token prediction modules after the last block (0: none)."""
    mtp_loss_weight: float = 0.3
    """The weight of the mean of the prediction modules' losses."""

    @property
    def head_size(self) -> int:
        """Each attention head's width (grouped-query attention)."""
        return self.head_dim or self.n_embd // self.n_head

    @property
    def rope_dim(self) -> int:
        """The width the rotary angles turn: a head's, or latent attention's rotary part."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_size

    def __post_init__(self) -> None:
        if self.n_head <= 0 or (self.n_embd % self.n_head and not self.head_dim
                                and self.mla is None):
            raise ConfigError(f"model.n_head = {self.n_head} does not divide model.n_embd = "
                              f"{self.n_embd}: choose a head count that divides it")
        if self.mla is not None:
            return  # latent attention's widths are its own (MLAConfig checks them)
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
    mla = mla_config(cfg)
    return LlamaConfig(vocab_size=cfg.vocab_size, block_size=cfg.block_size,
                       n_layer=cfg.n_layer, n_head=cfg.n_head,
                       n_kv_head=cfg.n_head if mla else cfg.n_kv_head or cfg.n_head,
                       n_embd=cfg.n_embd, ffn_hidden=ffn_hidden, rope_theta=cfg.rope_theta,
                       norm_eps=cfg.norm_eps, tie_embeddings=cfg.tie_embeddings,
                       dropout=cfg.dropout, head_dim=cfg.head_dim, qk_norm=cfg.qk_norm, moe=moe,
                       moe_layers=moe_layer_indices(cfg.moe_layers, cfg.n_layer)
                       if moe is not None else (),
                       routed_scaling_factor=cfg.routed_scaling_factor, mla=mla,
                       mtp_depth=cfg.mtp_depth, mtp_loss_weight=cfg.mtp_loss_weight)


def mla_config(cfg: ModelConfig) -> MLAConfig | None:
    """Multi-head latent attention's widths of a `[model]` section (None: attention =
    "mha").

    Raises:
        ConfigError: a latent width with attention = "mha", or one out of range
            (MLAConfig's checks).
    """
    check_attention(cfg)
    if cfg.attention != "mla":
        return None
    return MLAConfig(kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim,
                     qk_nope_head_dim=cfg.qk_nope_head_dim, v_head_dim=cfg.v_head_dim,
                     q_lora_rank=cfg.q_lora_rank)


def moe_config(cfg: ModelConfig) -> MoEConfig | None:
    """The MoE blocks' shape and rules of a `[model]` section (None: every block dense);
    moe_inter_size 0 means the dense MLP's width.

    Raises:
        ConfigError: a rule out of range (MoEConfig's checks, and the router's groups').
    """
    if not cfg.n_experts:
        return None
    moe = MoEConfig(
        n_experts=cfg.n_experts, experts_per_token=cfg.experts_per_token,
        hidden=cfg.moe_inter_size or cfg.ffn_hidden or llama_ffn_hidden(cfg.n_embd),
        n_shared_experts=cfg.n_shared_experts, router=cfg.router,
        norm_topk_prob=cfg.norm_topk_prob, aux_loss_weight=cfg.aux_loss_weight,
        capacity_factor=cfg.capacity_factor, n_group=cfg.n_group, topk_group=cfg.topk_group)
    check_groups(moe.n_experts, moe.experts_per_token, moe.n_group, moe.topk_group)
    return moe


def parameter_count(cfg: LlamaConfig, active: bool = False, mtp: bool = True) -> int:
    """Parameters of `Llama(cfg)` (a tied head counted once), without building it; with
    `active`, those one token uses: of each MoE layer's routed experts only the k it goes
    to (the router, its bias included, and the shared experts count in both; the embedding
    whole, as for a dense model). `mtp`: with the multi-token prediction modules; without,
    the main model alone, as DeepSeek counts its 671B (their checkpoint's 685B adds the
    module with its own copies of the embedding and head)."""
    dim = cfg.n_embd
    total = 0
    for i in range(cfg.n_layer):
        total += _block_count(cfg, cfg.moe is not None and i in cfg.moe_layers, active)
    if mtp and cfg.mtp_depth:  # each: 3 norms, the projection, a block like the last one
        last_moe = cfg.moe is not None and cfg.n_layer - 1 in cfg.moe_layers
        total += cfg.mtp_depth * (3 * dim + 2 * dim * dim + _block_count(cfg, last_moe, active))
    embeddings = cfg.vocab_size * dim * (1 if cfg.tie_embeddings else 2)
    return embeddings + total + dim


def _block_count(cfg: LlamaConfig, moe: bool, active: bool) -> int:
    """Parameters of one block: its attention, its MLP (dense, or MoE with `active`'s
    experts) and its two norms."""
    dim = cfg.n_embd
    mlp = 3 * dim * cfg.ffn_hidden
    if moe and cfg.moe is not None:
        m = cfg.moe
        used = m.experts_per_token if active else m.n_experts
        mlp = (m.n_experts * (dim + 1) + used * 3 * dim * m.hidden
               + m.n_shared_experts * 3 * dim * m.hidden)
    return _attention_count(cfg) + mlp + 2 * dim


def _attention_count(cfg: LlamaConfig) -> int:
    """Parameters of one block's attention: grouped-query, or latent (its projections and
    the two latent norms)."""
    dim, heads, m = cfg.n_embd, cfg.n_head, cfg.mla
    if m is None:
        head_dim = cfg.head_size
        count = 2 * dim * heads * head_dim + 2 * dim * cfg.n_kv_head * head_dim
        return count + (2 * head_dim if cfg.qk_norm else 0)
    queries = (dim * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * m.qk_head_dim
               if m.q_lora_rank else dim * heads * m.qk_head_dim)
    latent = dim * m.cached_per_token + m.kv_lora_rank
    decompressed = m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
    return queries + latent + decompressed + heads * m.v_head_dim * dim


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
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
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
    """A pre-norm transformer block: grouped-query or latent attention (`cfg.mla`), then a
    SwiGLU MLP or, with `moe`, the mixture of experts `cfg.moe`."""

    def __init__(self, cfg: LlamaConfig, moe: bool = False) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn: nn.Module = Attention(cfg) if cfg.mla is None else LatentAttention(
            cfg.n_embd, cfg.n_head, cfg.mla, cfg.rope_theta, cfg.dropout)
        self.mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp: nn.Module = MLP(cfg)
        if moe and cfg.moe is not None:
            layer = MoE(cfg.moe, cfg.n_embd)
            layer.gate.scale = cfg.routed_scaling_factor  # not (yet) a MoEConfig field
            self.mlp = layer

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
        self.mtp: MultiTokenPrediction | None = None
        if cfg.mtp_depth:  # each module's block is of the last block's kind (DeepSeek-V3: MoE)
            last_moe = cfg.n_layer - 1 in cfg.moe_layers
            self.mtp = MultiTokenPrediction(
                [Block(cfg, last_moe) for _ in range(cfg.mtp_depth)], cfg.n_embd,
                cfg.norm_eps, cfg.mtp_loss_weight)
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

    def ahead_loss(self, idx: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor,
                   weight: float | None) -> torch.Tensor | None:
        """The multi-token prediction modules' weighted loss, while training
        (dtrain.models.mtp); None without them."""
        if self.mtp is None or not self.training:
            return None
        positions = self.documents.positions if self.documents is not None else None
        return self.mtp(self, idx, hidden, targets, weight, positions)

    @property
    def predicts_ahead(self) -> bool:
        return self.mtp is not None

    # How the pipeline cuts it (dtrain.models.Stages). The MTP modules go with the last
    # stage, and the embedding they read with them too: a pipeline ties its two holders'
    # copies (dtrain.pipeline.tied_weights), as it does a head tied to it.
    def stage_parts(self) -> tuple[list[str], str, list[str]]:
        ahead = ["mtp", "embed"] if self.mtp is not None else []
        return ["embed"], "blocks", ["norm", "head", *ahead]

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
            head_dim = self.cfg.rope_dim
            cos, sin = rotary(t, head_dim, self.cfg.rope_theta, x.device, x.dtype,
                              self.positions(t, x.device).reshape(-1))
            if self.documents is not None:  # each row its own positions: (batch, 1, t, d)
                cos, sin = (z.view(-1, 1, t, head_dim) for z in (cos, sin))
            self._rope_cache = (key, (cos, sin))
        return self._rope_cache[1]
