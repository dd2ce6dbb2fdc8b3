"""dtrain's built-in models in Hugging Face's format: the config, and the parameter names.

dtrain's GPT is Hugging Face's `GPT2LMHeadModel` and dtrain's Llama its `LlamaForCausalLM`,
weight for weight; only the names differ, and GPT-2 keeps its linear layers' weights as
[in, out] (its `Conv1D`), transposed from nn.Linear's [out, in]. `dtrain export --format hf`
writes a model through these maps, and `init_from` reads a Hugging Face folder through them.

    config = hf_config_of(cfg)                # -> config.json
    for name, tensor in model.state_dict().items():
        hf_name, transposed = hf_names(cfg)[name]
"""

from __future__ import annotations

from typing import Any

from dtrain.errors import ConfigError
from dtrain.models.config import ModelConfig
from dtrain.models.llama import llama_config


def _check_arch(cfg: ModelConfig) -> None:
    if cfg.arch not in ("gpt", "llama"):
        raise ConfigError(f"model.arch = {cfg.arch!r} has no Hugging Face format in dtrain: "
                          "only its built-in models (gpt, llama) do")


def hf_config_of(cfg: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config (config.json's contents) of the model `cfg` (resolved)
    describes: a GPT2LMHeadModel for arch "gpt", a LlamaForCausalLM for arch "llama".

    Raises:
        ConfigError: another arch, or an inconsistent Llama shape.
    """
    _check_arch(cfg)
    # dtrain's byte-level data has no special tokens: none rather than GPT-2's 50256.
    common = {"vocab_size": cfg.vocab_size, "bos_token_id": None, "eos_token_id": None,
              "initializer_range": 0.02, "dtype": "float32"}
    if cfg.arch == "gpt":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common,
                "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
                "n_positions": cfg.block_size, "n_inner": 4 * cfg.n_embd,
                "activation_function": "gelu",  # exact, as dtrain's F.gelu
                "layer_norm_epsilon": 1e-5, "resid_pdrop": cfg.dropout,
                "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
                "tie_word_embeddings": True}
    llama = llama_config(cfg)
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
            "hidden_size": llama.n_embd, "intermediate_size": llama.ffn_hidden,
            "num_hidden_layers": llama.n_layer, "num_attention_heads": llama.n_head,
            "num_key_value_heads": llama.n_kv_head, "head_dim": llama.n_embd // llama.n_head,
            "max_position_embeddings": llama.block_size,
            # transformers 5 reads rope_parameters; earlier versions read rope_theta.
            "rope_theta": llama.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": llama.rope_theta},
            "rms_norm_eps": llama.norm_eps, "tie_word_embeddings": llama.tie_embeddings,
            "attention_bias": False, "mlp_bias": False, "attention_dropout": llama.dropout,
            "hidden_act": "silu"}


def _gpt_names(cfg: ModelConfig) -> dict[str, tuple[str, bool]]:
    names = {"wte.weight": ("transformer.wte.weight", False),
             "wpe.weight": ("transformer.wpe.weight", False)}
    block = {"ln1": ("ln_1", False), "attn.qkv": ("attn.c_attn", True),
             "attn.proj": ("attn.c_proj", True), "ln2": ("ln_2", False),
             "mlp.fc": ("mlp.c_fc", True), "mlp.proj": ("mlp.c_proj", True)}
    for i in range(cfg.n_layer):
        for ours, (theirs, transposed) in block.items():
            names[f"blocks.{i}.{ours}.weight"] = (f"transformer.h.{i}.{theirs}.weight",
                                                 transposed)
            names[f"blocks.{i}.{ours}.bias"] = (f"transformer.h.{i}.{theirs}.bias", False)
    names["ln_f.weight"] = ("transformer.ln_f.weight", False)
    names["ln_f.bias"] = ("transformer.ln_f.bias", False)
    return names


def _llama_names(cfg: ModelConfig) -> dict[str, tuple[str, bool]]:
    names = {"embed.weight": ("model.embed_tokens.weight", False)}
    block = {"attn_norm": "input_layernorm", "attn.q_proj": "self_attn.q_proj",
             "attn.k_proj": "self_attn.k_proj", "attn.v_proj": "self_attn.v_proj",
             "attn.o_proj": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
             "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj"}
    for i in range(cfg.n_layer):
        for ours, theirs in block.items():
            names[f"blocks.{i}.{ours}.weight"] = (f"model.layers.{i}.{theirs}.weight", False)
    names["norm.weight"] = ("model.norm.weight", False)
    if not cfg.tie_embeddings:
        names["head.weight"] = ("lm_head.weight", False)
    return names


def hf_names(cfg: ModelConfig) -> dict[str, tuple[str, bool]]:
    """dtrain parameter name (as `model.named_parameters()` gives it: a tied head is not
    listed) -> (the Hugging Face parameter name, whether the tensor is stored transposed
    there), for the model `cfg` (resolved) describes.

    Raises:
        ConfigError: an arch other than gpt or llama.
    """
    _check_arch(cfg)
    return _gpt_names(cfg) if cfg.arch == "gpt" else _llama_names(cfg)
