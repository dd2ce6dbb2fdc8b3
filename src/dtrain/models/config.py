"""The `[model]` section: which model `dtrain train` builds, and its shape.

    arch = "gpt"                       # dtrain's GPT (the default)
    arch = "llama"; preset = "llama-tiny"          # dtrain's Llama, a published shape
    arch = "hf"; hf_config = "my-model/"           # any Hugging Face causal LM
    arch = "custom"; factory = "my_pkg.models:build"   # your own nn.Module

The shape keys (n_layer, n_embd, ...) serve the built-in models; a `preset` fills them
with a published shape, and any key set to something other than its default overrides
the preset. `vocab_size = 0` takes the data's vocabulary (256 for bytes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dtrain.errors import ConfigError

ARCHS = ("gpt", "llama", "hf", "custom")


@dataclass
class ModelConfig:
    arch: str = "gpt"
    """gpt (dtrain's GPT-2-style model), llama (dtrain's Llama), hf (a Hugging Face causal
    LM from hf_config or init_from) or custom (your own module from factory)."""
    preset: str = ""
    """A named shape for the built-in models (e.g. "llama-tiny", "llama-3-8b")."""
    vocab_size: int = 0
    """Number of token ids; 0 takes the data's (256 for bytes)."""
    block_size: int = 128
    """Longest context, in tokens; the training sequences' length."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 128
    """Width of the residual stream."""
    n_kv_head: int = 0
    """Llama: key/value heads (grouped-query attention); 0 means n_head."""
    ffn_hidden: int = 0
    """Llama: the SwiGLU MLP's hidden width; 0 means Llama's rule (8/3 n_embd, rounded up
    to a multiple of 256)."""
    rope_theta: float = 10000.0
    """Llama: the base of the rotary position embedding."""
    norm_eps: float = 1e-5
    """Llama: RMSNorm's epsilon."""
    tie_embeddings: bool = True
    """Llama: the output head shares the token embedding's weight (GPT always does)."""
    dropout: float = 0.0
    """Dropout probability; 0 keeps runs reproducible."""
    hf_config: str = ""
    """arch = "hf": a Hugging Face config.json, or a folder holding one."""
    init_from: str = ""
    """A Hugging Face folder of safetensors weights to start from (arch llama or hf)."""
    factory: str = ""
    """arch = "custom": "package.module:function" returning the nn.Module."""
    tp_plan: dict[str, str] = field(default_factory=dict)
    """Tensor-parallel plan for a model without a built-in one: module-name pattern ->
    colwise, rowwise, vocab or vocab_loss (dtrain.tensor_parallel.parallelize)."""


SHAPE_KEYS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "n_kv_head",
              "ffn_hidden", "rope_theta", "norm_eps", "tie_embeddings")


def with_preset(cfg: ModelConfig, presets: dict[str, tuple[str, dict]]) -> ModelConfig:
    """`cfg` with its preset's shape filled in (keys left at their defaults take the
    preset's value).

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
    return dataclasses.replace(cfg, **{k: v for k, v in shape.items()
                                       if getattr(cfg, k) == getattr(default, k)})


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
