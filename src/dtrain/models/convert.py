"""dtrain's built-in models in Hugging Face's format: the config, and the parameter names.

dtrain's GPT is Hugging Face's `GPT2LMHeadModel` and dtrain's Llama its `LlamaForCausalLM`,
weight for weight (with MoE blocks, its `MixtralForCausalLM`, or with per-head norms its
`Qwen3MoeForCausalLM`; with latent attention its `DeepseekV3ForCausalLM`, whose folders
also hold the multi-token prediction modules after the last layer, as DeepSeek's own
checkpoint does, where transformers' model ignores them); only the names differ, GPT-2
keeps its linear layers' weights as [in, out] (its `Conv1D`), transposed from nn.Linear's
[out, in], and the MoE models' files keep a tensor per expert where dtrain stacks them
(`Stacked`). `dtrain export --format hf` writes a model through these maps, and
`init_from` reads a Hugging Face folder through them.

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
    if family == "deepseek_v3":
        return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                **common, **{k: v for k, v in shape.items() if k != "head_dim"},
                **_deepseek_shape(llama)}
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


def _deepseek_shape(llama: LlamaConfig) -> dict[str, Any]:
    """DeepseekV3Config's keys for latent attention, its MoE blocks (all but the first
    `first_k_dense_replace`; none: every block dense) and its prediction modules."""
    mla, moe = llama.mla, llama.moe
    assert mla is not None
    return {"q_lora_rank": mla.q_lora_rank or None, "kv_lora_rank": mla.kv_lora_rank,
            "qk_nope_head_dim": mla.qk_nope_head_dim, "qk_rope_head_dim": mla.qk_rope_head_dim,
            "v_head_dim": mla.v_head_dim, "rope_interleave": True,
            "first_k_dense_replace": llama.n_layer - len(llama.moe_layers),
            "n_routed_experts": moe.n_experts if moe else 1,
            "num_experts_per_tok": moe.experts_per_token if moe else 1,
            "moe_intermediate_size": moe.hidden if moe else llama.ffn_hidden,
            "n_shared_experts": moe.n_shared_experts if moe else 0,
            "n_group": moe.n_group if moe else 1, "topk_group": moe.topk_group if moe else 1,
            "norm_topk_prob": moe.norm_topk_prob if moe else True,
            "routed_scaling_factor": llama.routed_scaling_factor,
            "num_nextn_predict_layers": llama.mtp_depth}


def _deepseek_family(llama: LlamaConfig) -> str:
    """"deepseek_v3" for latent attention, if DeepseekV3ForCausalLM computes this shape:
    a sigmoid router over all but the first blocks, no per-head norms.

    Raises:
        ConfigError: a shape it does not compute.
    """
    moe = llama.moe
    if llama.qk_norm:
        raise ConfigError("Hugging Face's DeepseekV3ForCausalLM has no per-head norms: this "
                          "model (model.qk_norm) has no Hugging Face format in dtrain")
    if moe is not None and moe.router != "sigmoid_bias":
        raise ConfigError("Hugging Face's DeepseekV3ForCausalLM routes by sigmoid_bias: this "
                          "model (model.router) has no Hugging Face format in dtrain")
    if llama.moe_layers != tuple(range(llama.n_layer - len(llama.moe_layers), llama.n_layer)):
        raise ConfigError("Hugging Face's DeepseekV3ForCausalLM has MoE blocks after its first "
                          "dense ones: set model.moe_layers = \"after K\"")
    return "deepseek_v3"


def _llama_family(llama: LlamaConfig) -> str:
    """Which Hugging Face model dtrain's Llama of this shape is: llama (dense), mixtral
    (MoE in every block, no per-head norms), qwen3_moe (MoE, per-head norms) or
    deepseek_v3 (latent attention).

    Raises:
        ConfigError: a shape none of them has.
    """
    if llama.mla is not None:
        return _deepseek_family(llama)
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


LATENT_ATTENTION = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                    "kv_a_layernorm", "kv_b_proj", "o_proj")
"""The weighted modules of latent attention, named as in transformers' DeepseekV3Attention
(q_proj without a query bottleneck, q_a_proj to q_b_proj with one)."""


def _block_names(llama: LlamaConfig, family: str, ours: str, theirs: str, moe: bool
                 ) -> dict[str, tuple[HFName, bool]]:
    """The names of one block: dtrain's under `ours` ("blocks.3"), the folder's under
    `theirs` ("model.layers.3"); `moe`: its MLP is the mixture of experts."""
    block = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
    if llama.mla is not None:
        wanted = ("q_a_proj", "q_a_layernorm", "q_b_proj") if llama.mla.q_lora_rank else \
            ("q_proj",)
        block.update({f"attn.{n}": f"self_attn.{n}" for n in LATENT_ATTENTION
                      if n in wanted or not n.startswith("q_")})
    else:
        block.update({f"attn.{n}": f"self_attn.{n}"
                      for n in ("q_proj", "k_proj", "v_proj", "o_proj")})
    if llama.qk_norm:
        block.update({"attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"})
    if not moe or llama.moe is None:
        block.update({"mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj",
                      "mlp.down": "mlp.down_proj"})
    names: dict[str, tuple[HFName, bool]] = {
        f"{ours}.{a}.weight": (f"{theirs}.{b}.weight", False) for a, b in block.items()}
    if moe and llama.moe is not None:
        places = expert_places(family, theirs, llama.moe.n_experts,
                               llama.moe.n_shared_experts > 0)
        names.update({f"{ours}.mlp.{a}": (place, False) for a, place in places.items()})
    return names


def _llama_names(cfg: ModelConfig) -> dict[str, tuple[HFName, bool]]:
    llama = llama_config(cfg)
    family = _llama_family(llama)
    names: dict[str, tuple[HFName, bool]] = {"embed.weight": ("model.embed_tokens.weight", False)}
    for i in range(cfg.n_layer):
        names.update(_block_names(llama, family, f"blocks.{i}", f"model.layers.{i}",
                                  i in llama.moe_layers))
    names["norm.weight"] = ("model.norm.weight", False)
    if not cfg.tie_embeddings:
        names["head.weight"] = ("lm_head.weight", False)
    last_moe = cfg.n_layer - 1 in llama.moe_layers
    for d in range(llama.mtp_depth):  # DeepSeek's layout: layers after the last one
        ours, theirs = f"mtp.depths.{d}", f"model.layers.{cfg.n_layer + d}"
        names.update(_block_names(llama, family, f"{ours}.block", theirs, last_moe))
        for a, b in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
                     ("norm", "shared_head.norm")):
            names[f"{ours}.{a}.weight"] = (f"{theirs}.{b}.weight", False)
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
