"""dtrain's built-in models in Hugging Face's format: the config, and the parameter names.

dtrain's GPT is Hugging Face's `GPT2LMHeadModel` and dtrain's Llama its `LlamaForCausalLM`,
weight for weight (with MoE blocks, its `MixtralForCausalLM`, or with per-head norms its
`Qwen3MoeForCausalLM`); only the names differ, GPT-2 keeps its linear layers' weights as
[in, out] (its `Conv1D`), transposed from nn.Linear's [out, in], and the MoE models' files
keep a tensor per expert where dtrain stacks them (`Stacked`). `dtrain export --format hf`
writes a model through these maps, and `init_from` reads a Hugging Face folder through them.

    config = hf_config_of(cfg)                # -> config.json
    for name, tensor in model.state_dict().items():
        hf_name, transposed = hf_names(cfg)[name]
"""

from __future__ import annotations

from typing import Any

from dtrain.errors import ConfigError
from dtrain.models.config import ModelConfig
from dtrain.models.hf_places import HFName, expert_places
from dtrain.models.llama import LlamaConfig, llama_config


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
    family = _llama_family(llama)
    shape = {"hidden_size": llama.n_embd, "intermediate_size": llama.ffn_hidden,
             "num_hidden_layers": llama.n_layer, "num_attention_heads": llama.n_head,
             "num_key_value_heads": llama.n_kv_head, "head_dim": llama.head_size,
             "max_position_embeddings": llama.block_size,
             # transformers 5 reads rope_parameters; earlier versions read rope_theta.
             "rope_theta": llama.rope_theta,
             "rope_parameters": {"rope_type": "default", "rope_theta": llama.rope_theta},
             "rms_norm_eps": llama.norm_eps, "tie_word_embeddings": llama.tie_embeddings,
             "attention_bias": False, "attention_dropout": llama.dropout,
             "hidden_act": "silu"}
    if family == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
                **shape, "mlp_bias": False}
    moe = llama.moe
    assert moe is not None
    routed = {"num_experts_per_tok": moe.experts_per_token, "output_router_logits": False,
              "router_aux_loss_coef": moe.aux_loss_weight}
    if family == "mixtral":
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **common,
                **shape, **routed, "intermediate_size": moe.hidden,
                "num_local_experts": moe.n_experts, "sliding_window": None}
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **common,
            **shape, **routed, "num_experts": moe.n_experts, "moe_intermediate_size": moe.hidden,
            "norm_topk_prob": moe.norm_topk_prob, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(llama.n_layer) if i not in llama.moe_layers],
            "use_sliding_window": False, "sliding_window": None}


def _llama_family(llama: LlamaConfig) -> str:
    """Which Hugging Face model dtrain's Llama of this shape is: llama (dense), mixtral
    (MoE in every block, no per-head norms) or qwen3_moe (MoE, per-head norms).

    Raises:
        ConfigError: a shape none of them has.
    """
    moe = llama.moe
    if moe is None:
        if llama.qk_norm:
            raise ConfigError("a dense Llama with model.qk_norm has no Hugging Face format in "
                              "dtrain yet: export it with OUT ending in .safetensors")
        return "llama"
    if moe.router != "softmax_topk" or moe.n_shared_experts:
        raise ConfigError("Hugging Face's Mixtral and Qwen3-MoE route by softmax_topk without "
                          "shared experts: this model (model.router, model.n_shared_experts) "
                          "has no Hugging Face format in dtrain")
    if llama.qk_norm:
        return "qwen3_moe"
    if len(llama.moe_layers) != llama.n_layer or not moe.norm_topk_prob:
        raise ConfigError("Hugging Face's Mixtral has a MoE in every block and renormalizes "
                          "its top-k weights: set model.moe_layers = \"all\" and "
                          "model.norm_topk_prob = true (or model.qk_norm for Qwen3-MoE)")
    return "mixtral"


def _gpt_names(cfg: ModelConfig) -> dict[str, tuple[HFName, bool]]:
    names: dict[str, tuple[HFName, bool]] = {
        "wte.weight": ("transformer.wte.weight", False),
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


def _llama_names(cfg: ModelConfig) -> dict[str, tuple[HFName, bool]]:
    llama = llama_config(cfg)
    family = _llama_family(llama)
    names: dict[str, tuple[HFName, bool]] = {"embed.weight": ("model.embed_tokens.weight", False)}
    block = {"attn_norm": "input_layernorm", "attn.q_proj": "self_attn.q_proj",
             "attn.k_proj": "self_attn.k_proj", "attn.v_proj": "self_attn.v_proj",
             "attn.o_proj": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm"}
    if llama.qk_norm:
        block.update({"attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"})
    dense = {"mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj"}
    for i in range(cfg.n_layer):
        layer = f"model.layers.{i}"
        for ours, theirs in block.items():
            names[f"blocks.{i}.{ours}.weight"] = (f"{layer}.{theirs}.weight", False)
        if i not in llama.moe_layers:
            for ours, theirs in dense.items():
                names[f"blocks.{i}.{ours}.weight"] = (f"{layer}.{theirs}.weight", False)
            continue
        assert llama.moe is not None
        for ours, place in expert_places(family, layer, llama.moe.n_experts).items():
            names[f"blocks.{i}.mlp.{ours}"] = (place, False)
    names["norm.weight"] = ("model.norm.weight", False)
    if not cfg.tie_embeddings:
        names["head.weight"] = ("lm_head.weight", False)
    return names


def hf_names(cfg: ModelConfig) -> dict[str, tuple[HFName, bool]]:
    """dtrain parameter name (as `model.named_parameters()` gives it: a tied head is not
    listed) -> (the Hugging Face parameter name, whether the tensor is stored transposed
    there), for the model `cfg` (resolved) describes.

    Raises:
        ConfigError: an arch other than gpt or llama.
    """
    _check_arch(cfg)
    return _gpt_names(cfg) if cfg.arch == "gpt" else _llama_names(cfg)
