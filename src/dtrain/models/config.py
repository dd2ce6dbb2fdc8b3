"""The `[model]` section: which model `dtrain train` builds, and its shape.

    arch = "gpt"                       # dtrain's GPT (the default)
    arch = "llama"; preset = "llama-tiny"          # dtrain's Llama, a published shape
    arch = "hf"; hf_config = "my-model/"           # any Hugging Face causal LM
    arch = "custom"; factory = "my_pkg.models:build"   # your own nn.Module

The shape keys (n_layer, n_embd, ...) serve the built-in models; a `preset` fills them
with a published shape, and a key the config sets (in its file or with `--set`) overrides
the preset, even when set to its default (`mtp_depth = 0` drops a preset's MTP module).
`vocab_size = 0` takes the data's vocabulary (256 for bytes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, get_args

from dtrain.errors import ConfigError
from dtrain.models.moe.router import RouterName
from dtrain.schema import non_negative, positive

Arch = Literal["gpt", "llama", "hf", "custom"]
"""The models `dtrain train` builds: dtrain's GPT or Llama, a Hugging Face causal LM, or a
user's module."""
ARCHS: tuple[str, ...] = get_args(Arch)

AttentionKind = Literal["mha", "mla"]
"""dtrain's Llama's attention: grouped-query (mha, the default: n_kv_head key/value heads,
which may be n_head) or DeepSeek's multi-head latent attention (mla, dtrain.models.mla)."""



@dataclass
class ModelConfig:
    # `explicit` (set in __post_init__) lives in a slot, beside the fields' __dict__: which
    # keys were written is no key of [model], so it stays out of the fields, asdict, vars()
    # (`ModelConfig(**vars(cfg))` copies a config) and ==.
    __slots__ = ("explicit", "__dict__", "__weakref__")

    arch: Arch = "gpt"
    """gpt (dtrain's GPT-2-style model), llama (dtrain's Llama), hf (a Hugging Face causal
    LM from hf_config or init_from) or custom (your own module from factory)."""
    preset: str = ""
    """A named shape for the built-in models (e.g. "llama-tiny", "llama-3-8b")."""
    vocab_size: int = non_negative(0)
    """Number of token ids; 0 takes the data's (256 for bytes)."""
    block_size: int = positive(128)
    """Longest context, in tokens; the training sequences' length."""
    n_layer: int = positive(4)
    """Transformer blocks."""
    n_head: int = positive(4)
    """Attention heads per block; must divide n_embd."""
    n_embd: int = positive(128)
    """Width of the residual stream."""
    n_kv_head: int = non_negative(0)
    """Llama: key/value heads (grouped-query attention); 0 means n_head."""
    ffn_hidden: int = non_negative(0)
    """Llama: the SwiGLU MLP's hidden width; 0 means Llama's rule (8/3 n_embd, rounded up
    to a multiple of 256)."""
    rope_theta: float = non_negative(10000.0)
    """Llama: the base of the rotary position embedding."""
    norm_eps: float = non_negative(1e-5)
    """Llama: RMSNorm's epsilon."""
    tie_embeddings: bool = True
    """Llama: the output head shares the token embedding's weight (GPT always does)."""
    dropout: float = non_negative(0.0)
    """Dropout probability; 0 keeps runs reproducible."""
    hf_config: str = ""
    """arch = "hf": a Hugging Face config.json, or a folder holding one."""
    init_from: str = ""
    """A Hugging Face folder of safetensors weights to start from (arch llama or hf)."""
    factory: str = ""
    """arch = "custom": "package.module:function" returning the nn.Module."""
    head_dim: int = non_negative(0)
    """Llama: each attention head's width; 0 means n_embd / n_head (Qwen3 sets its own)."""
    qk_norm: bool = False
    """Llama: RMSNorm each query and key head before the rotary embedding (Qwen3)."""
    n_experts: int = non_negative(0)
    """Llama: routed experts of each mixture-of-experts block; 0 keeps every block dense."""
    experts_per_token: int = positive(2)
    """With n_experts: the experts each token goes to (top-k)."""
    n_shared_experts: int = non_negative(0)
    """With n_experts: experts every token also passes through (DeepSeek's shared ones)."""
    moe_inter_size: int = non_negative(0)
    """With n_experts: each expert's hidden width; 0 means ffn_hidden."""
    moe_layers: str = "all"
    """With n_experts: the MoE blocks: "all", "after K" (all but the first K), "every N"
    (blocks N-1, 2N-1, ...: Qwen3-MoE's decoder_sparse_step) or a list like "1,3,5"; the
    others keep the dense MLP."""
    router: RouterName = "softmax_topk"
    """With n_experts: softmax_topk (Mixtral, Qwen3) or sigmoid_bias (DeepSeek-V3's
    auxiliary-loss-free balancing: a per-expert bias nudged toward even load each step)."""
    norm_topk_prob: bool = True
    """With n_experts: renormalize each token's k routing weights to sum to one."""
    aux_loss_weight: float = non_negative(0.0)
    """With n_experts: weight of the load-balancing loss added to the training loss; 0 is
    off."""
    capacity_factor: float = non_negative(0.0)
    """With n_experts: assignments an expert takes per sequence, as a multiple of an even
    share (later ones are dropped); 0 is dropless."""
    n_group: int = positive(1)
    """With n_experts: groups of experts for group-limited routing (DeepSeek-V3: 8): each
    token picks its experts within its topk_group best groups; 1 is no limit."""
    topk_group: int = positive(1)
    """With n_group: the groups each token picks its experts from (DeepSeek-V3: 4)."""
    routed_scaling_factor: float = positive(1.0)
    """With n_experts: what the routed experts' weights are multiplied by (DeepSeek-V3:
    2.5)."""
    attention: AttentionKind = "mha"
    """Llama: mha (grouped-query attention, n_kv_head key/value heads) or mla (DeepSeek's
    multi-head latent attention: each head's keys and values decompressed from a latent of
    kv_lora_rank per token)."""
    q_lora_rank: int = non_negative(0)
    """With attention = "mla": the queries' bottleneck width; 0 is one plain query
    projection (DeepSeek-V2-Lite)."""
    kv_lora_rank: int = non_negative(0)
    """With attention = "mla": the latent's width (what generation's cache keeps per
    token, with qk_rope_head_dim)."""
    qk_nope_head_dim: int = non_negative(0)
    """With attention = "mla": each head's query and key part without positions."""
    qk_rope_head_dim: int = non_negative(0)
    """With attention = "mla": each query's, and the key's shared, rotary part; even."""
    v_head_dim: int = non_negative(0)
    """With attention = "mla": each head's value width."""
    mtp_depth: int = non_negative(0)
    """Llama: DeepSeek-V3's multi-token prediction modules, each predicting one token
    further ahead while training; 0 is off."""
    mtp_loss_weight: float = non_negative(0.3)
    """With mtp_depth: the weight of the mean of the modules' losses added to the training
    loss (DeepSeek-V3: 0.3, then 0.1)."""
    tp_plan: dict[str, str] = field(default_factory=dict)
    """Tensor-parallel plan for a model without a built-in one: module-name pattern ->
    colwise, rowwise, vocab or vocab_loss (dtrain.tensor_parallel.parallelize)."""

    def __post_init__(self) -> None:
        # The keys set explicitly (the config loader records those of the [model] table
        # and of --set): each keeps its value over the preset's, even its default
        # (with_preset). Config.to_dict carries it to the ranks; copies and `replaced`
        # keep it, dataclasses.replace does not.
        self.explicit: frozenset[str] = frozenset()

    def check(self) -> None:
        if self.dropout >= 1:
            raise ConfigError(f"model.dropout = {self.dropout} must be below 1 (a probability)")



MOE_KEYS = ("n_experts", "experts_per_token", "n_shared_experts", "moe_inter_size",
            "moe_layers", "router", "norm_topk_prob", "aux_loss_weight", "capacity_factor",
            "n_group", "topk_group", "routed_scaling_factor")
"""The mixture-of-experts keys (dtrain's Llama only)."""

MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim")
"""The widths of multi-head latent attention (dtrain's Llama with attention = "mla")."""

MTP_KEYS = ("mtp_depth", "mtp_loss_weight")
"""The multi-token prediction keys (dtrain's Llama only)."""

SHAPE_KEYS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "n_kv_head",
              "ffn_hidden", "rope_theta", "norm_eps", "tie_embeddings", "head_dim", "qk_norm",
              *MOE_KEYS, "attention", *MLA_KEYS, *MTP_KEYS)


def with_preset(cfg: ModelConfig, presets: dict[str, tuple[str, dict]]) -> ModelConfig:
    """`cfg` with its preset's shape filled in: a key the user set keeps its value, every
    other key the preset names takes the preset's. A key counts as set when it is in
    `cfg.explicit` (a config file's `[model]` table or `--set`: `mtp_depth = 0` there
    turns a preset's MTP module off) or its value differs from ModelConfig's default.

    A ModelConfig built in Python records no explicit keys, so a keyword passed at its
    default (`ModelConfig(arch="llama", preset="deepseek-tiny", mtp_depth=0)`) cannot be
    told from one left out and takes the preset's value; to keep it, name it in
    `cfg.explicit` first, or `dataclasses.replace` the resolved config. The result keeps
    `cfg.explicit`, so applying the preset again changes nothing.

    Raises:
        ConfigError: an unknown preset, or one of another arch.
    """
    if not cfg.preset:
        return cfg
    if cfg.preset not in presets:
        names = ", ".join(n for n, (arch, _) in presets.items())
        raise ConfigError(f"model.preset = {cfg.preset!r} is unknown: use one of {names}")
    arch, shape = presets[cfg.preset]
    if arch != cfg.arch:
        raise ConfigError(f"model.preset = {cfg.preset!r} is a shape of arch {arch!r}: set "
                          f"model.arch = {arch!r}")
    default = ModelConfig()
    return replaced(cfg, **{k: v for k, v in shape.items()
                            if k not in cfg.explicit and getattr(cfg, k) == getattr(default, k)})


def replaced(cfg: ModelConfig, **changes: object) -> ModelConfig:
    """`dataclasses.replace(cfg, **changes)` that keeps `cfg.explicit` (the keys the user
    set, which a fresh ModelConfig starts without), so that a preset applied to the result
    again changes nothing."""
    out = dataclasses.replace(cfg, **changes)  # type: ignore[arg-type]  # field values
    out.explicit = cfg.explicit
    return out


def check_shape(cfg: ModelConfig, tp: int) -> None:
    """The built-in models' shape keys against each other and the tensor-parallel degree
    (a preset's shape, and the other archs, are checked once built).

    Raises:
        ConfigError: the heads do not divide the width, or tp does not divide a count.
    """
    if cfg.arch not in ("gpt", "llama") or cfg.preset:
        return
    if cfg.n_embd % cfg.n_head:
        raise ConfigError(f"model.n_head = {cfg.n_head} does not divide model.n_embd = "
                          f"{cfg.n_embd}: choose a head count that divides the width")
    for count, what in ((cfg.n_head, "model.n_head"), (cfg.vocab_size, "model.vocab_size"),
                        (cfg.n_kv_head, "model.n_kv_head")):
        if count % tp:
            raise ConfigError(f"parallel.tp = {tp} does not divide {what} = {count}: choose "
                              f"a tensor-parallel degree that divides {count}")


def moe_layer_indices(spec: str, n_layer: int) -> tuple[int, ...]:
    """The blocks `model.moe_layers` names among n_layer: "all", "after K", "every N" or
    a comma-separated list of block indices.

    Raises:
        ConfigError: a spec of another form, or an index outside the model.
    """
    words = spec.split()
    try:
        if spec == "all":
            return tuple(range(n_layer))
        if len(words) == 2 and words[0] == "after":
            return tuple(range(int(words[1]), n_layer))
        if len(words) == 2 and words[0] == "every" and int(words[1]) > 0:
            step = int(words[1])
            return tuple(i for i in range(n_layer) if (i + 1) % step == 0)
        chosen = tuple(sorted({int(w) for w in spec.split(",")}))
    except ValueError:
        chosen = None
    if not chosen or not all(0 <= i < n_layer for i in chosen):
        raise ConfigError(f"model.moe_layers = {spec!r} must be \"all\", \"after K\", \"every "
                          f"N\" or block indices in [0, {n_layer}) like \"1,3\"")
    return chosen


def check_moe(cfg: ModelConfig) -> None:
    """The mixture-of-experts keys: only dtrain's Llama has MoE blocks, with a positive
    expert count and blocks that exist (dtrain.models.llama.moe_config checks the rules;
    the expert-parallel degree is checked with the layout).

    Raises:
        ConfigError: MoE keys on another arch, or a value out of range.
    """
    default = ModelConfig()
    changed = [k for k in MOE_KEYS if getattr(cfg, k) != getattr(default, k)]
    if cfg.arch != "llama" and changed:
        raise ConfigError(f"model.{changed[0]} is a mixture-of-experts key, which only "
                          f"model.arch = \"llama\" has (not {cfg.arch!r})")
    if cfg.arch != "llama" or not cfg.n_experts:
        return
    if cfg.n_experts < 0:
        raise ConfigError(f"model.n_experts = {cfg.n_experts} must be 0 (dense) or positive")
    moe_layer_indices(cfg.moe_layers, cfg.n_layer)


def check_attention(cfg: ModelConfig) -> None:
    """The attention and multi-token prediction keys: only dtrain's Llama has them, and
    the latent widths only with attention = "mla" (dtrain.models.llama.mla_config checks
    their values; the layouts they run in are dtrain.models.rules').

    Raises:
        ConfigError: such a key on another arch, a latent width with attention = "mha", or
            more prediction depths than a row has tokens.
    """
    default = ModelConfig()
    changed = [k for k in ("attention", *MLA_KEYS, *MTP_KEYS)
               if getattr(cfg, k) != getattr(default, k)]
    if cfg.arch != "llama" and changed:
        raise ConfigError(f"model.{changed[0]} is a key of dtrain's Llama (model.arch = "
                          f"\"llama\"), not of {cfg.arch!r}")
    latent = [k for k in MLA_KEYS if getattr(cfg, k)]
    if cfg.attention == "mha" and latent:
        raise ConfigError(f"model.{latent[0]} = {getattr(cfg, latent[0])} is a width of "
                          "multi-head latent attention: set model.attention = \"mla\", or "
                          f"model.{latent[0]} = 0")
    grouped = [k for k in ("n_kv_head", "head_dim", "qk_norm") if getattr(cfg, k)]
    if cfg.attention == "mla" and grouped:
        raise ConfigError(f"model.{grouped[0]} is a key of grouped-query attention, and "
                          "model.attention = \"mla\" decompresses each head's keys from its "
                          "latent (widths qk_nope_head_dim, qk_rope_head_dim, v_head_dim): "
                          f"leave model.{grouped[0]} unset")
    if cfg.mtp_depth >= cfg.block_size:
        raise ConfigError(f"model.mtp_depth = {cfg.mtp_depth} predicts beyond a row of "
                          f"model.block_size = {cfg.block_size} tokens: lower it")
