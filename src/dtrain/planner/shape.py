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

from dtrain.errors import ConfigError
from dtrain.models.config import ModelConfig
from dtrain.models.gpt import GPTConfig
from dtrain.models.llama import LlamaConfig, llama_config, llama_ffn_hidden

FAMILIES = ("gpt", "llama")
REQUIRED = ("layers", "hidden", "heads", "seq", "vocab")


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

    def __post_init__(self) -> None:
        if self.arch not in FAMILIES:
            raise ConfigError(f"model shape arch={self.arch!r} is unknown: use gpt or llama")
        for key in REQUIRED:
            if getattr(self, key) < 1:
                raise ConfigError(f"model shape {key}={getattr(self, key)} must be positive")
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

    def _check_experts(self) -> None:
        for key in ("head_dim", "experts", "top_k", "moe_ffn", "shared_experts", "moe_layers",
                    "lora"):
            if getattr(self, key) < 0:
                raise ConfigError(f"model shape {key}={getattr(self, key)} must be positive")
        if self.arch == "gpt" and (self.qk_norm or self.head_dim not in (
                0, self.hidden // self.heads)):
            raise ConfigError("model shape head_dim and qk_norm are for arch=llama")
        if not self.experts:
            given = [k for k in ("top_k", "moe_ffn", "shared_experts", "moe_layers")
                     if getattr(self, k)]
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

    @classmethod
    def of(cls, config: ModelConfig | GPTConfig | LlamaConfig) -> ModelShape:
        """The shape of dtrain's GPT or Llama: a resolved `[model]` section (presets
        applied, vocabulary set), or the model's own config.

        Raises:
            ConfigError: a Hugging Face or custom model, which has no shape here.
        """
        if isinstance(config, ModelConfig):
            if config.arch not in FAMILIES:
                raise ConfigError(f"model.arch = {config.arch!r} has no shape for the planner: "
                                  "describe it with --model-shape layers=..,hidden=..,heads=..,"
                                  "seq=..,vocab=..")
            config = llama_config(config) if config.arch == "llama" else GPTConfig(
                vocab_size=config.vocab_size, block_size=config.block_size,
                n_layer=config.n_layer, n_head=config.n_head, n_embd=config.n_embd,
                dropout=config.dropout)
        if isinstance(config, LlamaConfig):
            moe = config.moe
            return cls(config.n_layer, config.n_embd, config.n_head, config.block_size,
                       config.vocab_size, "llama", kv_heads=config.n_kv_head,
                       ffn=config.ffn_hidden, tied=config.tie_embeddings,
                       dropout=config.dropout > 0, head_dim=config.head_size,
                       qk_norm=config.qk_norm,
                       experts=moe.n_experts if moe else 0,
                       top_k=moe.experts_per_token if moe else 0,
                       moe_ffn=moe.hidden if moe else 0,
                       shared_experts=moe.n_shared_experts if moe else 0,
                       moe_layers=len(config.moe_layers) if moe else 0)
        return cls(config.n_layer, config.n_embd, config.n_head, config.block_size,
                   config.vocab_size, "gpt", dropout=config.dropout > 0)

    @property
    def gated(self) -> bool:
        """A SwiGLU MLP (three matrices) rather than GeLU (two)."""
        return self.arch == "llama"

    @property
    def attention_width(self) -> int:
        """Width of the queries and of attention's output: heads x head_dim."""
        return self.heads * self.head_dim

    @property
    def dense_layers(self) -> int:
        """Blocks whose MLP is dense (all of them without experts)."""
        return self.layers - self.moe_layers

    def attention_params(self) -> int:
        """Weights of one block's attention: the q, k, v and output projections."""
        q, kv = self.attention_width, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden

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
        if self.gated:  # RMSNorm weights only, the per-head norms, the router's bias
            return self.block_matmul_params(moe, active) + 2 * h + \
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

    def parameters(self) -> int:
        """Every parameter, every expert included."""
        return self.dense_layers * self.block_params() + \
            self.moe_layers * self.block_params(moe=True) + self.embedding_params()

    def active_parameters(self) -> int:
        """The parameters one token uses: of each MoE block's routed experts only top_k
        (dtrain.models.llama.parameter_count(cfg, active=True))."""
        return self.dense_layers * self.block_params() + \
            self.moe_layers * self.block_params(moe=True, active=True) + \
            self.embedding_params()

    def attention_flops_per_token(self) -> float:
        """Forward FLOPs per token of the scores and the weighted sum, all layers."""
        return 4.0 * self.layers * self.seq * self.attention_width

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
        weights = self.active_block_matmul_params() + self.vocab * self.hidden
        return 6.0 * weights + (1.5 if causal else 3) * self.attention_flops_per_token()

    def recompute_flops_per_token(self, recompute: str) -> float:
        """What recomputation adds per token: one more forward of what it recomputes."""
        if recompute == "full":
            return 2.0 * self.active_block_matmul_params() + \
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
        trains = (f"; LoRA rank {self.lora}" if self.lora else "") + \
            ("; DPO" if self.dpo else "")
        return (f"{self.arch} {self.layers}x{self.hidden} ({self.heads} heads{kv}, ffn "
                f"{self.ffn}, seq {self.seq}, vocab {self.vocab}{experts}{trains})")


_KEYS = {f.name: f.type for f in dataclasses.fields(ModelShape)}


def parse_shape(text: str) -> ModelShape:
    """A shape from `--model-shape`'s "key=value,key=value" (keys: the ModelShape fields;
    a MoE shape adds experts=, top_k= and optionally moe_ffn=, shared_experts=,
    moe_layers=).

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
        if key == "arch":
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
