"""A transformer by its shape alone: parameters, FLOPs and activation bytes, no tensors.

Both planners know a model by its `ModelShape`. The analytic planner
(dtrain.planner.analytic) plans models far bigger than this machine could trace and needs
nothing else; the traced one (dtrain.planner.traced) keeps it beside what it traced, for
the tp degrees the heads allow and the FLOPs of a step:

    shape = parse_shape("layers=80,hidden=12288,heads=96,seq=2048,vocab=51200")
    shape = ModelShape.of(config.model)   # a resolved [model] section, a GPTConfig or a
                                          # LlamaConfig
    shape.parameters()              # 145.6e9 = 12·l·h²(1 + 13/(12h) + (V+s)/(12lh))
    shape.flops_per_token("full")   # 96·l·h²(1 + s/(6h) + V/(16lh)) per token

Two families:

- `gpt` (GPT-2/GPT-3, Megatron-LM's GPT): LayerNorm with bias, fused QKV with biases, a
  GeLU MLP of `ffn` (4·hidden by default), learned positions, the output head tied to the
  token embedding, dropout after attention and the MLP.
- `llama`: RMSNorm, grouped-query attention (`kv_heads` of them, of `head_dim` each,
  hidden / heads by default; `qk_norm` adds Qwen3's per-head norms), a SwiGLU MLP of
  `ffn` (Llama's rule by default), rotary positions, no biases, an untied head, no dropout.

A llama shape may have mixture-of-experts blocks (dtrain.models.moe): in `moe_layers` of
its blocks (all of them by default) the MLP is a router over `experts` SwiGLU experts of
`moe_ffn` each (`ffn` by default), of which each token goes to `top_k`, plus
`shared_experts` every token passes through. `parameters()` counts every expert,
`active_parameters()` those one token uses (the k routed experts, the shared ones, the
router), as dtrain.models.llama.parameter_count does; FLOPs follow the active ones.
Group-limited routing (DeepSeek-V3's `n_group` groups of experts, of which each token
picks `topk_group` before its k experts) changes no count here, only how many machines a
token's experts lie on (dtrain.planner.analytic.dispatch).

DeepSeek-V3's shape (a llama shape with `attention=mla`) has multi-head latent attention
(MLA; DeepSeek-AI 2024, arXiv 2405.04434 and 2412.19437): each block projects its input
down to a query latent of `q_lora_rank` (0: no query latent, the queries projected
directly, as DeepSeek-V2-Lite) and a key/value latent of `kv_lora_rank` plus one rotary
key of `qk_rope_head_dim` shared by every head, then up to each head's query and key of
`qk_nope_head_dim + qk_rope_head_dim` and value of `v_head_dim`; an RMSNorm on each
latent. Per block and token:

    projections   h·q_lora + q_lora·heads·(nope+rope)     (or h·heads·(nope+rope))
                  + h·(kv_lora+rope) + kv_lora·heads·(nope+v) + heads·v·h
    attention     2·s·heads·(nope+rope) + 2·s·heads·v      forward FLOPs, scores and sum
    KV cache      (kv_lora + rope) elements                (MHA/GQA: 2·kv_heads·head_dim)

(`attention_projections`, `attention_flops_per_token`, `kv_cache_bytes`). The heads split
over tp with their up-projections; the down-projections are whole on every tp rank (the
latent serves every head). `head_dim` is then the query/key head's width.

Multi-token prediction (`mtp_depth` D, DeepSeek-V3's MTP): D more modules after the last
block, each an RMSNorm of the previous depth's hidden state and of the embedding of the
token one further ahead, their concatenation projected 2h -> h, one block of the last
block's kind and the shared output head. `parameters()` leaves them out, as DeepSeek's
671B does (`mtp_parameters()`, 11.7B for DeepSeek-V3's one module, which shares the
embedding and the head); the FLOPs of a step count them (each depth: its block, the
projection and the head's logits again, as Megatron-Core counts them).

Training FLOPs per token count every matrix multiply, as the literature does (Kaplan et
al. 2020; Narayanan et al. 2021; PaLM's MFU): 6 per weight that multiplies (forward 2,
backward 4; of a MoE block's experts, the k a token goes to and the shared ones), the
output head's included and the embedding lookup not, plus attention's scores and weighted
sum, 12·l·h·s (its causal half is not subtracted, as in those papers; h is heads x
head_dim where a head has its own width).
Recomputation adds one more forward of what it recomputes: `full` the blocks (2 per block
weight, 4·l·h·s), `selective` the attention core (4·l·h·s).

What trains: `lora=R` says LoRA adapters of rank R train beside the attention's and the
dense MLPs' projections and the rest is frozen (`trained_parameters()`: gradients and
optimizer state for the adapters alone; backward computes no weight gradient of the
base); `dpo=true` adds DPO's reference forward, without gradient, beside each forward.
The FLOPs above stay the model's (as MFU counts them); the planners count what a step
does.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

from dtrain.errors import ConfigError
from dtrain.models.config import ModelConfig
from dtrain.models.gpt import GPTConfig
from dtrain.models.llama import LlamaConfig, llama_config, llama_ffn_hidden

FAMILIES = ("gpt", "llama")
REQUIRED = ("layers", "hidden", "heads", "seq", "vocab")
ATTENTIONS = ("mha", "mla")
LATENT_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
               "v_head_dim")
"""MLA's widths, as `[model]` names them (dtrain.models.config)."""
SHAPE_KEYS = (*LATENT_KEYS, "attention", "mtp_depth", "n_group", "topk_group")
"""The keys a shape reads from a model's config by name (`model_keys`)."""


class Projection(NamedTuple):
    """One of attention's linear layers: `inputs` x `outputs` weights, and how tensor
    parallelism splits it: "column" (its outputs, by heads), "row" (its inputs) or "whole"
    (every tp rank computes all of it: MLA's down-projections, whose latent every head
    reads)."""

    inputs: int
    outputs: int
    split: str


def model_keys(config: object) -> dict[str, object]:
    """The MLA, MTP and group-routing keys (SHAPE_KEYS) of a model config: a `[model]`
    section, a LlamaConfig, or either's `mla` or `moe` part, read by name where they are
    set (a config that has none of them is a plain one: the planner reads a model the same
    way before and after its config gains these keys)."""
    places = [config, getattr(config, "mla", None), getattr(config, "moe", None)]
    found: dict[str, object] = {}
    for key in SHAPE_KEYS:
        for place in places:
            value = getattr(place, key, None) if place is not None else None
            if isinstance(value, (int, str)) and not isinstance(value, bool):
                found[key] = value
                break
    if found.get("attention") not in ATTENTIONS:
        found["attention"] = "mla" if found.get("kv_lora_rank") else "mha"
    groups = found.get("n_group", 0)
    if not isinstance(groups, int) or groups <= 1:  # one group (the config's default) is
        found.update(n_group=0, topk_group=0)      # no limit
    return found


@dataclass(frozen=True)
class ModelShape:
    """One decoder-only transformer's shape (see the module doc for the families)."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    arch: str = "gpt"
    kv_heads: int = 0  # 0: as many as heads (multi-head attention)
    ffn: int = 0  # 0: the family's rule (4h for gpt, Llama's for llama)
    tied: bool | None = None  # None: the family's (gpt tied, llama not)
    dropout: bool | None = None  # None: the family's (gpt on, llama off)
    head_dim: int = 0  # 0: hidden / heads
    qk_norm: bool = False  # an RMSNorm on each query and key head (Qwen3)
    experts: int = 0  # routed experts per MoE block; 0: every block dense
    top_k: int = 0  # experts each token goes to (required with experts)
    moe_ffn: int = 0  # each expert's hidden width; 0: ffn
    shared_experts: int = 0  # experts every token passes through
    moe_layers: int = 0  # blocks with experts (the last ones); 0: all, with experts
    lora: int = 0  # LoRA adapters of this rank train, the rest frozen; 0: every parameter
    dpo: bool = False  # DPO: a reference forward, without gradient, beside each one
    attention: str = "mha"  # "mha" (grouped-query included) or "mla" (latent attention)
    q_lora_rank: int = 0  # MLA: the query latent's width; 0: queries projected directly
    kv_lora_rank: int = 0  # MLA: the key/value latent's width (required with mla)
    qk_nope_head_dim: int = 0  # MLA: each query/key head's part without rotary positions
    qk_rope_head_dim: int = 0  # MLA: its rotary part (the key's shared by every head)
    v_head_dim: int = 0  # MLA: each value head's width
    mtp_depth: int = 0  # multi-token prediction modules after the last block
    n_group: int = 0  # group-limited routing: groups of experts; 0: none
    topk_group: int = 0  # the groups each token picks its experts from

    def __post_init__(self) -> None:
        if self.arch not in FAMILIES:
            raise ConfigError(f"model shape arch={self.arch!r} is unknown: use gpt or llama")
        for key in REQUIRED:
            if getattr(self, key) < 1:
                raise ConfigError(f"model shape {key}={getattr(self, key)} must be positive")
        self._check_latent()
        if self.hidden % self.heads and not self.head_dim:
            raise ConfigError(f"model shape heads={self.heads} does not divide "
                              f"hidden={self.hidden}: give head_dim")
        kv = self.kv_heads or self.heads
        if kv < 1 or self.heads % kv:
            raise ConfigError(f"model shape kv_heads={self.kv_heads} does not divide "
                              f"heads={self.heads}")
        if self.arch == "gpt" and kv != self.heads:
            raise ConfigError("model shape kv_heads is for arch=llama (grouped-query "
                              "attention); gpt has one key/value head per query head")
        if self.ffn < 0:
            raise ConfigError(f"model shape ffn={self.ffn} must be positive")
        self._check_experts()
        object.__setattr__(self, "kv_heads", kv)
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if not self.ffn:
            object.__setattr__(self, "ffn", 4 * self.hidden if self.arch == "gpt"
                               else llama_ffn_hidden(self.hidden))
        if self.tied is None:
            object.__setattr__(self, "tied", self.arch == "gpt")
        if self.dropout is None:
            object.__setattr__(self, "dropout", self.arch == "gpt")
        if self.experts:
            object.__setattr__(self, "moe_ffn", self.moe_ffn or self.ffn)
            object.__setattr__(self, "moe_layers", self.moe_layers or self.layers)

    def _check_latent(self) -> None:
        """MLA's keys only with attention=mla (and arch=llama), which needs kv_lora_rank,
        the query/key head's width and v_head_dim; its heads are their own key/value heads
        (kv_heads = heads) and head_dim is the query/key head's width."""
        for key in (*LATENT_KEYS, "mtp_depth"):
            if getattr(self, key) < 0:
                raise ConfigError(f"model shape {key}={getattr(self, key)} must be positive")
        if self.attention not in ATTENTIONS:
            raise ConfigError(f"model shape attention={self.attention!r} is unknown: use mha "
                              "or mla")
        if self.attention == "mha":
            given = [k for k in LATENT_KEYS if getattr(self, k)]
            if given:
                raise ConfigError(f"model shape {', '.join(given)} describe latent attention: "
                                  "add attention=mla, or leave them out")
            return
        if self.arch != "llama":
            raise ConfigError("model shape attention=mla is for arch=llama: add arch=llama")
        missing = [k for k in ("kv_lora_rank", "v_head_dim") if not getattr(self, k)]
        if missing or not self.qk_nope_head_dim + self.qk_rope_head_dim:
            missing += [] if missing else ["qk_nope_head_dim or qk_rope_head_dim"]
            raise ConfigError(f"model shape attention=mla needs {', '.join(missing)}: give "
                              "the latent's and the heads' widths")
        if self.kv_heads not in (0, self.heads):
            raise ConfigError(f"model shape kv_heads={self.kv_heads}: latent attention gives "
                              "every head its own key and value (leave kv_heads out)")
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.head_dim not in (0, qk):
            raise ConfigError(f"model shape head_dim={self.head_dim} with attention=mla is the "
                              f"query/key head's qk_nope_head_dim + qk_rope_head_dim = {qk}: "
                              "leave head_dim out")
        object.__setattr__(self, "head_dim", qk)

    def _check_experts(self) -> None:
        for key in ("head_dim", "experts", "top_k", "moe_ffn", "shared_experts", "moe_layers",
                    "lora", "n_group", "topk_group"):
            if getattr(self, key) < 0:
                raise ConfigError(f"model shape {key}={getattr(self, key)} must be positive")
        if self.arch == "gpt" and (self.qk_norm or self.head_dim not in (
                0, self.hidden // self.heads)):
            raise ConfigError("model shape head_dim and qk_norm are for arch=llama")
        if not self.experts:
            given = [k for k in ("top_k", "moe_ffn", "shared_experts", "moe_layers",
                                 "n_group", "topk_group") if getattr(self, k)]
            if given:
                raise ConfigError(f"model shape {', '.join(given)} describe experts: give "
                                  "experts=E (routed experts per MoE block) too")
            return
        if self.arch != "llama":
            raise ConfigError("model shape experts= is for arch=llama (dtrain's MoE blocks "
                              "are Llama's): add arch=llama")
        if not 1 <= self.top_k <= self.experts:
            raise ConfigError(f"model shape top_k={self.top_k} must lie in [1, experts="
                              f"{self.experts}]: give top_k=K, the experts each token goes to")
        if self.moe_layers > self.layers:
            raise ConfigError(f"model shape moe_layers={self.moe_layers} is more than the "
                              f"{self.layers} layers")
        if bool(self.n_group) != bool(self.topk_group):
            raise ConfigError("model shape group-limited routing needs both n_group= and "
                              "topk_group= (or neither)")
        if self.n_group and (self.experts % self.n_group or self.topk_group > self.n_group):
            which = (f"n_group={self.n_group} does not divide experts={self.experts}"
                     if self.experts % self.n_group else
                     f"topk_group={self.topk_group} is more than n_group={self.n_group}")
            raise ConfigError(f"model shape {which}: pick groups that split the experts, "
                              "topk_group of them at most")

    @classmethod
    def of(cls, config: ModelConfig | GPTConfig | LlamaConfig) -> ModelShape:
        """The shape of dtrain's GPT or Llama: a resolved `[model]` section (presets
        applied, vocabulary set), or the model's own config.

        Raises:
            ConfigError: a Hugging Face or custom model, which has no shape here.
        """
        keys = model_keys(config)
        if isinstance(config, ModelConfig):
            if config.arch not in FAMILIES:
                raise ConfigError(f"model.arch = {config.arch!r} has no shape for the planner: "
                                  "describe it with --model-shape layers=..,hidden=..,heads=..,"
                                  "seq=..,vocab=..")
            config = llama_config(config) if config.arch == "llama" else GPTConfig(
                vocab_size=config.vocab_size, block_size=config.block_size,
                n_layer=config.n_layer, n_head=config.n_head, n_embd=config.n_embd,
                dropout=config.dropout)
            keys = {**model_keys(config), **keys}  # the section's, where it has them
        if isinstance(config, LlamaConfig):
            moe = config.moe
            latent = keys["attention"] == "mla"
            if not moe:
                keys.update(n_group=0, topk_group=0)
            return cls(config.n_layer, config.n_embd, config.n_head, config.block_size,
                       config.vocab_size, "llama",
                       kv_heads=config.n_head if latent else config.n_kv_head,
                       ffn=config.ffn_hidden, tied=config.tie_embeddings,
                       dropout=config.dropout > 0,
                       head_dim=0 if latent else config.head_size,
                       qk_norm=config.qk_norm,
                       experts=moe.n_experts if moe else 0,
                       top_k=moe.experts_per_token if moe else 0,
                       moe_ffn=moe.hidden if moe else 0,
                       shared_experts=moe.n_shared_experts if moe else 0,
                       moe_layers=len(config.moe_layers) if moe else 0,
                       **{k: v for k, v in keys.items()  # type: ignore[arg-type]
                          if latent or k not in LATENT_KEYS})
        return cls(config.n_layer, config.n_embd, config.n_head, config.block_size,
                   config.vocab_size, "gpt", dropout=config.dropout > 0)

    @property
    def gated(self) -> bool:
        """A SwiGLU MLP (three matrices) rather than GeLU (two)."""
        return self.arch == "llama"

    @property
    def latent(self) -> bool:
        """Multi-head latent attention (attention=mla)."""
        return self.attention == "mla"

    @property
    def attention_width(self) -> int:
        """Width of the queries (and keys, per head): heads x head_dim."""
        return self.heads * self.head_dim

    @property
    def value_width(self) -> int:
        """Width of the values and of attention's output: heads x v_head_dim (MLA), else
        the queries'."""
        return self.heads * self.v_head_dim if self.latent else self.attention_width

    @property
    def qkv_width(self) -> int:
        """Per token, the widths of the queries, keys and values attention's core reads:
        q + 2·kv_heads·head_dim (MHA/GQA); heads·(2·(nope+rope) + v) (MLA, decompressed)."""
        if self.latent:
            return 2 * self.attention_width + self.value_width
        return self.attention_width + 2 * self.kv_heads * self.head_dim

    @property
    def key_value_width(self) -> int:
        """Per token, the keys' and values' elements attention's core reads (what context
        parallelism exchanges): 2·kv_heads·head_dim, or MLA's decompressed heads·(nope +
        rope + v)."""
        return self.qkv_width - self.attention_width

    @property
    def latent_width(self) -> int:
        """Per token, MLA's latents: q_lora_rank + kv_lora_rank + qk_rope_head_dim (0 for
        MHA)."""
        return self.q_lora_rank + self.kv_lora_rank + self.qk_rope_head_dim if self.latent \
            else 0

    @property
    def dense_layers(self) -> int:
        """Blocks whose MLP is dense (all of them without experts)."""
        return self.layers - self.moe_layers

    @property
    def mtp_moe(self) -> bool:
        """Whether a multi-token prediction module's block has experts: it is of the last
        block's kind, and the MoE blocks are the last ones."""
        return self.moe_layers > 0

    def attention_projections(self) -> tuple[Projection, ...]:
        """One block's attention projections, in order: MHA/GQA's fused q, k, v and its
        output; MLA's query down and up (or one query projection), key/value down (with
        the shared rotary key), key/value up and output (the module doc)."""
        h = self.hidden
        if not self.latent:
            return (Projection(h, self.qkv_width, "column"),
                    Projection(self.attention_width, h, "row"))
        if self.q_lora_rank:
            queries: tuple[Projection, ...] = (
                Projection(h, self.q_lora_rank, "whole"),
                Projection(self.q_lora_rank, self.attention_width, "column"))
        else:
            queries = (Projection(h, self.attention_width, "column"),)
        return (*queries,
                Projection(h, self.kv_lora_rank + self.qk_rope_head_dim, "whole"),
                Projection(self.kv_lora_rank, self.heads * (self.qk_nope_head_dim +
                                                            self.v_head_dim), "column"),
                Projection(self.value_width, h, "row"))

    def attention_params(self) -> int:
        """Weights of one block's attention: its projections' (`attention_projections`)."""
        return sum(p.inputs * p.outputs for p in self.attention_projections())

    def kv_cache_bytes(self, element_bytes: int = 2) -> int:
        """Bytes of one token's cached keys and values, all layers: 2·kv_heads·head_dim
        elements a layer (MHA/GQA), or MLA's latent and rotary key, kv_lora_rank +
        qk_rope_head_dim (what DeepSeek's inference caches; bf16 by default)."""
        per_layer = self.kv_lora_rank + self.qk_rope_head_dim if self.latent else \
            2 * self.kv_heads * self.head_dim
        return self.layers * per_layer * element_bytes

    def expert_params(self) -> int:
        """Weights of one expert (a SwiGLU MLP of moe_ffn)."""
        return 3 * self.hidden * self.moe_ffn

    def moe_matmul_params(self, active: bool = False) -> int:
        """Weights that multiply in one MoE block's MLP: the router, every routed expert
        (or, `active`, the k a token goes to) and the shared experts."""
        routed = self.top_k if active else self.experts
        return self.experts * self.hidden + (routed + self.shared_experts) * \
            self.expert_params()

    def block_matmul_params(self, moe: bool = False, active: bool = False) -> int:
        """Weights of one block that multiply activations (no biases, no norms): a dense
        block's, or with `moe` a MoE block's (`active`: what one token uses)."""
        if moe:
            return self.attention_params() + self.moe_matmul_params(active)
        return self.attention_params() + (3 if self.gated else 2) * self.hidden * self.ffn

    def block_params(self, moe: bool = False, active: bool = False) -> int:
        """Every parameter of one block (a MoE block's with `moe`; `active`: those one
        token uses)."""
        h = self.hidden
        if self.gated:  # RMSNorm weights only, the per-head norms, the router's bias,
            # MLA's norms of its latents
            latent = self.q_lora_rank + self.kv_lora_rank if self.latent else 0
            return self.block_matmul_params(moe, active) + 2 * h + latent + \
                (2 * self.head_dim if self.qk_norm else 0) + (self.experts if moe else 0)
        # biases of QKV (3h), the projection (h), the MLP (ffn + h); two LayerNorms (4h)
        return self.block_matmul_params() + 3 * h + h + self.ffn + h + 4 * h

    def adapter_params(self, moe: bool = False) -> int:
        """One block's LoRA adapters (rank `lora`, A and B beside each of the attention's
        and a dense MLP's projections: rank x (in + out) each; a MoE block's experts are
        not adapted); 0 without."""
        if not self.lora:
            return 0
        h, q, kv = self.hidden, self.attention_width, self.kv_heads * self.head_dim
        if self.arch == "gpt":  # one fused qkv (h -> 3h) and the output projection
            sides = (h + 3 * q) + (q + h)
        elif self.latent:  # each of MLA's projections
            sides = sum(p.inputs + p.outputs for p in self.attention_projections())
        else:  # q, k, v and o apart
            sides = (h + q) + 2 * (h + kv) + (q + h)
        if not moe:
            sides += (3 if self.gated else 2) * (h + self.ffn)
        return self.lora * sides

    def trained_parameters(self) -> int:
        """The parameters that train: the adapters with `lora`, else every one."""
        if not self.lora:
            return self.parameters()
        return self.dense_layers * self.adapter_params() + \
            self.moe_layers * self.adapter_params(moe=True)

    def expert_layer_params(self) -> int:
        """The routed experts' weights of all MoE blocks: what expert parallelism splits."""
        return self.moe_layers * self.experts * self.expert_params()

    def expert_degrees(self, dp: int) -> list[int]:
        """The expert-parallel degrees a layout of `dp` data-parallel ranks may take: those
        dividing both dp and the experts (1 alone for a model without experts)."""
        common = math.gcd(dp, self.experts) if self.experts else 1
        return [d for d in range(1, common + 1) if common % d == 0]

    def embedding_params(self) -> int:
        """Token (and learned position) embeddings, the final norm and an untied head."""
        h = self.hidden
        params = self.vocab * h + (self.seq * h if self.arch == "gpt" else 0)
        params += 2 * h if self.arch == "gpt" else h
        return params + (0 if self.tied else self.vocab * h)

    def mtp_parameters(self) -> int:
        """The multi-token prediction modules' parameters, which `parameters()` leaves out
        (as DeepSeek's 671B does): per depth, a block of the last block's kind, the 2h x h
        projection and three norms (of the hidden state, of the embedding, before the
        shared head); the embedding and the head are shared."""
        h = self.hidden
        return self.mtp_depth * (self.block_params(self.mtp_moe) + 2 * h * h + 3 * h)

    def mtp_matmul_params(self) -> int:
        """Weights that multiply a token in the multi-token prediction modules (the
        active ones of their blocks, and their projections; not the shared head)."""
        h = self.hidden
        return self.mtp_depth * (self.block_matmul_params(self.mtp_moe, active=True)
                                 + 2 * h * h)

    def parameters(self) -> int:
        """Every parameter, every expert included (not the multi-token prediction
        modules': `mtp_parameters`)."""
        return self.dense_layers * self.block_params() + \
            self.moe_layers * self.block_params(moe=True) + self.embedding_params()

    def active_parameters(self) -> int:
        """The parameters one token uses: of each MoE block's routed experts only top_k
        (dtrain.models.llama.parameter_count(cfg, active=True))."""
        return self.dense_layers * self.block_params() + \
            self.moe_layers * self.block_params(moe=True, active=True) + \
            self.embedding_params()

    def attention_flops_per_token(self) -> float:
        """Forward FLOPs per token of the scores and the weighted sum, all layers (and the
        multi-token prediction modules' blocks): 2·s·(heads·head_dim + heads·v) a layer,
        4·s·heads·head_dim for MHA."""
        return 2.0 * (self.layers + self.mtp_depth) * self.seq * \
            (self.attention_width + self.value_width)

    def active_block_matmul_params(self) -> int:
        """Weights that multiply a token in all blocks: dense blocks', and of the MoE
        blocks' the router, the k routed experts and the shared ones."""
        return self.dense_layers * self.block_matmul_params() + \
            self.moe_layers * self.block_matmul_params(moe=True, active=True)

    def model_flops_per_token(self, causal: bool = False) -> float:
        """Training FLOPs per token without recomputation (MFU's numerator): 6N + 12·l·h·s,
        N the weights that multiply a token (the active ones), the head's included;
        `causal`: attention's causal half only, 6·l·h·s (the products a causal kernel
        computes, as some runs count them: Llama 3's, benchmarks/RESULTS.md)."""
        weights = self.active_block_matmul_params() + self.mtp_matmul_params() + \
            self.vocab * self.hidden * (1 + self.mtp_depth)  # each depth's logits too
        return 6.0 * weights + (1.5 if causal else 3) * self.attention_flops_per_token()

    def recompute_flops_per_token(self, recompute: str) -> float:
        """What recomputation adds per token: one more forward of what it recomputes."""
        if recompute == "full":
            return 2.0 * (self.active_block_matmul_params() + self.mtp_matmul_params()) + \
                self.attention_flops_per_token()
        if recompute == "selective":
            return self.attention_flops_per_token()
        return 0.0

    def flops_per_token(self, recompute: str = "none") -> float:
        """Training FLOPs per token the hardware executes, recomputation included (what
        Megatron-LM's "achieved TFLOP/s" counts)."""
        return self.model_flops_per_token() + self.recompute_flops_per_token(recompute)

    def describe(self) -> str:
        """One line: `llama 48x2048 (32 heads, 4 kv heads, ffn 6144, seq 4096, vocab
        151936; 128 experts top-8 of 768 in 48 layers)`."""
        kv = f", {self.kv_heads} kv heads" if self.kv_heads != self.heads else ""
        experts = ""
        if self.experts:
            shared = f" + {self.shared_experts} shared" if self.shared_experts else ""
            experts = (f"; {self.experts} experts top-{self.top_k} of {self.moe_ffn}{shared} "
                       f"in {self.moe_layers} layers")
            if self.n_group:
                experts += f", {self.topk_group} of {self.n_group} groups"
        if self.latent:
            query = f"q latent {self.q_lora_rank}, " if self.q_lora_rank else ""
            kv = (f", MLA: {query}kv latent {self.kv_lora_rank}, heads "
                  f"{self.qk_nope_head_dim}+{self.qk_rope_head_dim}/{self.v_head_dim}")
        trains = (f"; MTP depth {self.mtp_depth}" if self.mtp_depth else "") + \
            (f"; LoRA rank {self.lora}" if self.lora else "") + ("; DPO" if self.dpo else "")
        return (f"{self.arch} {self.layers}x{self.hidden} ({self.heads} heads{kv}, ffn "
                f"{self.ffn}, seq {self.seq}, vocab {self.vocab}{experts}{trains})")


_KEYS = {f.name: f.type for f in dataclasses.fields(ModelShape)}


def parse_shape(text: str) -> ModelShape:
    """A shape from `--model-shape`'s "key=value,key=value" (keys: the ModelShape fields;
    a MoE shape adds experts=, top_k= and optionally moe_ffn=, shared_experts=,
    moe_layers=, n_group=, topk_group=; latent attention attention=mla with
    kv_lora_rank=, qk_nope_head_dim=, qk_rope_head_dim=, v_head_dim= and optionally
    q_lora_rank=; multi-token prediction mtp_depth=).

    Raises:
        ConfigError: an unknown key, a value that is not a number, a missing key, experts
            without top_k (and the shape's own checks).
    """
    values: dict[str, object] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in _KEYS:
            raise ConfigError(f"--model-shape {item!r}: give key=value with keys "
                              f"{', '.join(_KEYS)}")
        value = value.strip()
        if key in ("arch", "attention"):
            values[key] = value
        elif key in ("tied", "dropout", "qk_norm", "dpo"):
            if value not in ("0", "1", "true", "false"):
                raise ConfigError(f"--model-shape {key}={value}: give true or false")
            values[key] = value in ("1", "true")
        else:
            try:
                values[key] = int(value)
            except ValueError:
                raise ConfigError(f"--model-shape {key}={value!r} is not a whole "
                                  "number") from None
    missing = [k for k in REQUIRED if k not in values]
    if missing:
        raise ConfigError(f"--model-shape lacks {', '.join(missing)} (give at least "
                          f"{', '.join(REQUIRED)})")
    return ModelShape(**values)  # type: ignore[arg-type]
