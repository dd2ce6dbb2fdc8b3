"""What each model can be laid out with, checked before any rank starts: experts under
expert parallelism, sequences under context parallelism, heads under tensor parallelism,
latent attention and multi-token prediction in the layouts built for them so far
(`check_layout`), and which models compute the chunked loss (`check_loss`). The config
(dtrain.config) calls them with the model's section as its preset fills it.
"""

from __future__ import annotations

import json
from pathlib import Path

from dtrain.errors import ConfigError
from dtrain.mesh.config import ParallelConfig
from dtrain.mesh.dims import V_SHAPED
from dtrain.models.chunked_loss import LossKind
from dtrain.models.config import ModelConfig, check_attention, check_moe, check_shape
from dtrain.models.hf import (
    FAMILIES,
    LATENT_ATTENTION,
    ROTARY_FAMILY,
    hf_config_dict,
    hf_experts,
)
from dtrain.models.llama import mla_config, moe_config


def check_layout(m: ModelConfig, p: ParallelConfig) -> None:
    """Whether model `m` (its preset applied) can be laid out as `p` says.

    Raises:
        ConfigError: in one line naming what to change.
    """
    check_shape(m, p.tp)
    check_experts(m, p)
    check_context(m, p)
    check_latent(m, p)


def check_experts(m: ModelConfig, p: ParallelConfig) -> None:
    """Mixture of experts and expert parallelism: what they need and what they work with
    (so far)."""
    check_moe(m)
    experts = m.n_experts if m.arch == "llama" else 0
    if m.arch == "hf" and p.ep > 1:  # its config.json says (read only when it matters)
        experts = hf_experts(m)
    if experts and m.arch == "llama":
        moe_config(m)  # its rules: top-k within the experts, a known router, ...
    if experts and p.sequence_parallel and (m.capacity_factor or m.aux_loss_weight):
        raise ConfigError("parallel.sequence_parallel with model.capacity_factor or "
                          "model.aux_loss_weight: both are per whole sequence, and a tp rank "
                          "holds a part of each; use a dropless MoE (capacity_factor = 0) "
                          "balanced by model.router = \"sigmoid_bias\" (aux_loss_weight = 0)")
    if p.ep == 1:
        return
    if not experts:
        raise ConfigError(f"parallel.ep = {p.ep} splits experts, and this model has none: set "
                          "model.n_experts (dtrain's Llama, model.arch = \"llama\"), or "
                          "name a Mixtral or Qwen3-MoE config (model.arch = \"hf\")")
    if experts % p.ep:
        raise ConfigError(f"parallel.ep = {p.ep} does not divide model.n_experts = {experts}: "
                          "choose an expert-parallel degree that divides it")


def check_latent(m: ModelConfig, p: ParallelConfig) -> None:
    """Multi-head latent attention and multi-token prediction: their keys, the layouts
    built for them so far (data parallel, ZeRO, ep and cp for both; pipeline stages for
    dtrain's latent attention), and an `init_from` folder whose positions dtrain's Llama
    computes."""
    check_attention(m)
    if m.arch == "llama":
        mla_config(m)  # the latent widths' rules
        check_rope_of_folder(m)
    latent = m.arch == "llama" and m.attention == "mla"
    if m.arch == "hf" and (p.tp > 1 or p.cp > 1):  # its config.json says
        latent = hf_config_dict(m).get("model_type") in LATENT_ATTENTION
    # dtrain's Llama's latent attention runs under cp (its per-head keys and values go
    # through dtrain.context_parallel); transformers' DeepSeek-V3 attention is not wired to it
    # dtrain's Llama's also under tp (dtrain.tensor_parallel.latent_attention_plan)
    for degree, name in ((p.tp if m.arch == "hf" else 1, "tp"),
                         (p.cp if m.arch == "hf" else 1, "cp")):
        if latent and degree > 1:
            raise ConfigError(f"parallel.{name} = {degree} with multi-head latent attention is "
                              f"not supported yet: use parallel.{name} = 1 (dp, ZeRO, ep and "
                              "pp split it)")
    if m.arch == "llama" and m.mtp_depth and p.tp > 1 and p.sequence_parallel:
        raise ConfigError(f"model.mtp_depth = {m.mtp_depth} with parallel.sequence_parallel "
                          "is not supported yet: the MTP modules stay whole on each tp rank, "
                          "reading the whole sequence; set parallel.sequence_parallel = false")
    # tp: whole on each tp rank; cp: the tokens ahead gathered over the group (models.mtp);
    # pp: on the last stage, with a copy of the embedding tied to the first stage's
    if m.arch == "llama" and m.mtp_depth and p.pp > 1 and p.schedule in V_SHAPED:
        raise ConfigError(f"model.mtp_depth = {m.mtp_depth} with parallel.schedule = "
                          f"\"{p.schedule}\" is not supported yet: its V placement holds the "
                          "first and last stages on one rank, whose pieces would share the "
                          "embedding; use schedule \"1f1b\", \"interleaved\" or \"zb1p\"")


def check_rope_of_folder(m: ModelConfig) -> None:
    """dtrain's Llama started from a Hugging Face folder (`init_from`) whose config.json
    asks for yarn rope scaling (DeepSeek-V3's and Kimi K2's long contexts), which it does
    not compute (its frequencies and softmax scale differ at every position), or for
    latent attention's rotary part not interleaved, as DeepSeek's weights are.

    Raises:
        ConfigError: such a folder.
    """
    file = Path(m.init_from) / "config.json" if m.init_from else None
    if file is None or not file.is_file():
        return
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return  # the weights' reader says what is wrong with the folder
    if not isinstance(data, dict):
        return
    scaling = data.get("rope_scaling") or data.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind == "yarn":
        raise ConfigError(f"model.init_from = {m.init_from!r} scales rotary positions by yarn "
                          f"({file}), which dtrain's Llama does not compute: use model.arch = "
                          "\"hf\" (transformers does), or a config without rope scaling")
    if m.attention == "mla" and data.get("rope_interleave") is False:
        raise ConfigError(f"model.init_from = {m.init_from!r} keeps latent attention's rotary "
                          f"part not interleaved (rope_interleave = false in {file}), which "
                          "dtrain's Llama does not read: use model.arch = \"hf\"")


def check_context(m: ModelConfig, p: ParallelConfig) -> None:
    """Context parallelism: the models, sequence lengths and options it works with."""
    if p.cp == 1:
        return
    what = f"parallel.cp = {p.cp}"
    if m.arch not in ("gpt", "llama", "hf") or (
            m.arch == "hf" and hf_config_dict(m).get("model_type") not in ROTARY_FAMILY):
        raise ConfigError(f"{what} runs dtrain's GPT and Llama and Hugging Face models of the "
                          f"Llama family ({', '.join(ROTARY_FAMILY)}), not this model: use "
                          "parallel.cp = 1")
    if m.block_size % (2 * p.cp):
        raise ConfigError(f"{what} cuts each sequence into 2 x cp = {2 * p.cp} chunks, and "
                          f"model.block_size = {m.block_size} does not divide by "
                          f"{2 * p.cp}: make it a multiple of {2 * p.cp}")
    if p.sequence_parallel and (m.block_size // p.cp) % p.tp:
        raise ConfigError(f"{what} with parallel.sequence_parallel: each rank's "
                          f"{m.block_size // p.cp} tokens do not divide by parallel.tp = "
                          f"{p.tp}: make model.block_size a multiple of cp x tp")
    if m.dropout:
        raise ConfigError(f"{what} with model.dropout = {m.dropout}: attention dropout is not "
                          "split over the chunks; set model.dropout = 0")
    if m.arch == "llama" and m.n_experts and (m.capacity_factor or m.aux_loss_weight):
        raise ConfigError(f"{what} with model.capacity_factor or model.aux_loss_weight: both "
                          "are per whole sequence, and a cp rank holds two chunks of each; "
                          "use a dropless MoE (capacity_factor = 0) balanced by model.router = "
                          "\"sigmoid_bias\" (aux_loss_weight = 0)")
    if p.cp_method == "alltoall":
        heads = m.n_head // p.tp
        kv = (m.n_kv_head or m.n_head) // p.tp if m.arch == "llama" else heads
        if heads % p.cp or kv % p.cp:
            raise ConfigError(f"parallel.cp_method = \"alltoall\" splits each rank's {heads} "
                              f"query and {kv} key/value heads over cp = {p.cp}, which does not "
                              "divide them: use cp_method = \"ring\" or \"allgather\"")


def check_loss(m: ModelConfig, loss: LossKind) -> None:
    """`train.loss = "chunked"` takes the logits apart into the output head and the final
    hidden states (dtrain.models.chunked_loss): dtrain's GPT and Llama, and the Hugging
    Face families whose logits are `lm_head` on the base model's output; "auto" leaves
    the others the plain loss. What the built model holds (a LoRA adapter on its head) is
    checked as it is built.

    Raises:
        ConfigError: "chunked" for a custom module or another Hugging Face model type.
    """
    if loss != "chunked" or m.arch in ("gpt", "llama"):
        return
    model_type = hf_config_dict(m).get("model_type") if m.arch == "hf" else None
    if m.arch == "hf" and model_type in FAMILIES:
        return
    what = "model.arch = \"custom\" computes its own loss" if m.arch != "hf" else \
        f"the Hugging Face model type {model_type!r} is not one whose head dtrain knows " \
        f"({', '.join(FAMILIES)})"
    raise ConfigError(f"train.loss = \"chunked\": {what}: use train.loss = \"plain\" or "
                      "\"auto\"")
