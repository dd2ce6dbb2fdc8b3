"""Ready plans for the Hugging Face causal LMs dtrain wraps (`arch = "hf"`, dtrain.models.hf).

The same Megatron-LM split as dtrain's own models (plans.gpt_plan, plans.llama_plan), on
Hugging Face's module names behind the wrapper's `hf.`:

    model = build(resolve(ModelConfig(arch="hf", hf_config="llama/"), 256))
    parallelize(model, hf_plan(model), mesh.group("tp"))
    model.after_split(mesh.size("tp"))       # GPT-2 counts its heads itself

A model type without a plan here takes `[model] tp_plan`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from dtrain.errors import ConfigError
from dtrain.models.hf import HFCausalLM
from dtrain.tensor_parallel.parallelize import Colwise, Style

if TYPE_CHECKING:  # transformers is optional
    from transformers import PretrainedConfig

ROTARY_TYPES = ("llama", "mistral", "qwen2", "mixtral", "qwen3_moe")
QK_NORM_TYPES = ("qwen3_moe",)
"""Rotary model types whose attention normalizes each query and key head."""


def _rotary_plan(config: PretrainedConfig, dense: bool) -> dict[str, Style | str]:
    """Llama, Mistral, Qwen2, Mixtral, Qwen3-MoE: Q by query heads, K and V by key/value
    heads (Qwen2's biases split with them; Qwen3-MoE's per-head norms whole on every rank,
    their gradients summed over it: "headwise"),
    a dense SwiGLU's gate and up colwise and down rowwise. A MoE block (dtrain's layer,
    dtrain.models.hf) stays whole on every tp rank, as in dtrain's Llama; `dense`: whether
    any block has a dense MLP."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    layer = "hf.model.layers.*."
    return {
        "hf.model.embed_tokens": "vocab",
        f"{layer}self_attn.q_proj": Colwise(heads=heads),
        f"{layer}self_attn.k_proj": Colwise(heads=kv_heads),
        f"{layer}self_attn.v_proj": Colwise(heads=kv_heads),
        f"{layer}self_attn.o_proj": "rowwise",
        **({f"{layer}self_attn.q_norm": "headwise", f"{layer}self_attn.k_norm": "headwise"}
           if config.model_type in QK_NORM_TYPES else {}),
        **({f"{layer}mlp.gate_proj": "colwise", f"{layer}mlp.up_proj": "colwise",
            f"{layer}mlp.down_proj": "rowwise"} if dense else {}),
        "hf.lm_head": "colwise",
        "loss_fn": "vocab_loss",
    }


def _gpt2_plan(config: PretrainedConfig) -> dict[str, Style | str]:
    """GPT-2: the fused QKV (a Conv1D, an nn.Linear once wrapped) split by heads in each of
    its three parts; position embeddings and LayerNorms stay replicated."""
    layer = "hf.transformer.h.*."
    return {
        "hf.transformer.wte": "vocab",
        f"{layer}attn.c_attn": Colwise(chunks=3, heads=config.n_head),
        f"{layer}attn.c_proj": "rowwise",
        f"{layer}mlp.c_fc": "colwise",
        f"{layer}mlp.c_proj": "rowwise",
        "hf.lm_head": "colwise",
        "loss_fn": "vocab_loss",
    }


def _example(model: HFCausalLM) -> str:
    """A pattern naming the model's first linear layer in every block, for the message."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            return ".".join("*" if part.isdigit() else part for part in name.split("."))
    return "hf.<module path>"


def hf_plan(model: HFCausalLM) -> dict[str, Style | str]:
    """The plan of a wrapped Hugging Face causal LM, by its `config.model_type`: llama,
    mistral, qwen2 or gpt2. The embedding and the head split by vocabulary (tied or not:
    both sides split alike, so a tie survives) and the loss is vocab-parallel; every
    block's attention splits by heads and its MLP column- then row-parallel.

    `parallelize` raises ConfigError when tp does not divide the heads (the key/value
    heads for grouped-query attention), the MLP width or the vocabulary.

    Raises:
        ConfigError: a model type with no plan here.
    """
    config = model.hf.config
    if config.model_type in ROTARY_TYPES:
        dense = any(name.endswith(".mlp.gate_proj") for name, _ in model.named_modules())
        return _rotary_plan(config, dense)
    if config.model_type == "gpt2":
        return _gpt2_plan(config)
    raise ConfigError(f"no tensor-parallel plan for Hugging Face model type "
                      f"{config.model_type!r} (dtrain has one for "
                      f"{', '.join((*ROTARY_TYPES, 'gpt2'))}): pass one with [model] tp_plan = "
                      f"{{\"{_example(model)}\" = \"colwise\", ...}} (module-name pattern = "
                      "\"colwise\", \"rowwise\", \"vocab\" or \"vocab_loss\")")
