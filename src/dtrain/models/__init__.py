"""The models `dtrain train` builds from its `[model]` section, and what they promise.

    model = dtrain.models.build(resolve(config.model, data_vocab=256))
    logits, loss = model(idx, targets)          # every model; targets optional

| arch     | module            | model                                               |
|----------|-------------------|-----------------------------------------------------|
| gpt      | models/gpt.py     | dtrain's GPT (GPT-2's architecture, small)          |
| llama    | models/llama.py   | dtrain's Llama (RMSNorm, RoPE, SwiGLU, GQA)         |
| hf       | models/hf.py      | a Hugging Face causal LM, wrapped to the same calls |
| custom   | models/custom.py  | a user's module from `factory`                      |

Every model's forward takes (token ids, targets) and returns (logits, loss), or logits
without targets; a custom module may return a Hugging Face-style output with `.loss`
instead. A model that names its parts (`Stages`) can be cut into pipeline stages; one whose
logits are a head on its final hidden states (`chunked_loss.ChunkableLM`: GPT, Llama, the
Hugging Face families) can compute its training loss chunk by chunk, returning (None, loss).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from dtrain.errors import ConfigError
from dtrain.models.config import ARCHS, ModelConfig, replaced, with_preset
from dtrain.models.gpt import GPTConfig
from dtrain.models.stages import Stages

if TYPE_CHECKING:
    from dtrain.models.hf_places import HFName

__all__ = ["ARCHS", "ModelConfig", "Stages", "build", "gpt_config", "hf_names",
           "loss_of_output", "presets", "resolve"]


def presets() -> dict[str, tuple[str, dict[str, Any]]]:
    """Every named shape: preset -> (arch, shape keys)."""
    from dtrain.models.llama import PRESETS

    return dict(PRESETS)


def resolve(cfg: ModelConfig, data_vocab: int) -> ModelConfig:
    """`cfg` with its preset applied and its vocabulary fixed against the data's
    (`data_vocab` token ids).

    Raises:
        ConfigError: an unknown arch or preset, or a vocabulary smaller than the data's.
    """
    if cfg.arch not in ARCHS:
        raise ConfigError(f"model.arch = {cfg.arch!r} is unknown: use one of "
                          f"{', '.join(ARCHS)}")
    cfg = with_preset(cfg, presets())
    if cfg.vocab_size == 0:
        return replaced(cfg, vocab_size=data_vocab)  # resolved again, the preset applies alike
    if cfg.vocab_size < data_vocab:
        raise ConfigError(f"model.vocab_size = {cfg.vocab_size} is smaller than the data's "
                          f"vocabulary of {data_vocab} token ids: set it to at least "
                          f"{data_vocab} (or 0 to take the data's)")
    return cfg


def build(cfg: ModelConfig) -> nn.Module:
    """The model `cfg` (resolved) describes, freshly initialized from torch's current RNG
    (every rank seeds the same, so every rank builds the same model).

    Raises:
        ConfigError: the shape is inconsistent, or the Hugging Face config or the factory
            cannot give a causal LM.
    """
    if cfg.arch == "gpt":
        from dtrain.models.gpt import GPT

        return GPT(gpt_config(cfg))
    if cfg.arch == "llama":
        from dtrain.models.llama import Llama, llama_config

        return Llama(llama_config(cfg))
    if cfg.arch == "hf":
        from dtrain.models.hf import build_hf

        return build_hf(cfg)
    from dtrain.models.custom import build_custom

    return build_custom(cfg)


def hf_names(cfg: ModelConfig, model: nn.Module | None = None
             ) -> dict[str, tuple[HFName, bool]]:
    """dtrain parameter name -> (its Hugging Face name, whether it is stored transposed
    there) for the model `cfg` (resolved) describes; arch "hf" needs the `model` built
    from it (its Conv1D layers), the built-in archs only the shape.

    Raises:
        ConfigError: a custom model, which has no Hugging Face form.
    """
    if cfg.arch in ("gpt", "llama"):
        from dtrain.models.convert import hf_names as built_in_names

        return built_in_names(cfg)
    if cfg.arch == "hf":
        from dtrain.models.hf import HFCausalLM
        from dtrain.models.hf import hf_names as wrapped_names

        return wrapped_names(cast(HFCausalLM, model))  # what build_hf made of cfg
    raise ConfigError("a custom model has no Hugging Face form")


def gpt_config(cfg: ModelConfig) -> GPTConfig:
    """The shape of dtrain's GPT from a resolved `[model]`."""
    return GPTConfig(vocab_size=cfg.vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer,
                     n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout)


def loss_of_output(output: Any) -> torch.Tensor:
    """The loss of a model's output: `(logits, loss)` (logits None under the chunked loss)
    or an object with `.loss`."""
    loss = getattr(output, "loss", None)
    return loss if loss is not None else output[1]
