"""Any Hugging Face causal LM as a dtrain model (`arch = "hf"`).

    [model]
    arch = "hf"
    hf_config = "my-model/"         # its config.json, or the folder holding it

`build_hf` builds what transformers' AutoModelForCausalLM makes of the config, freshly
initialized from torch's current RNG (no download, no weights: `init_from` is loaded by
the layouts through `hf_names`), and wraps it in `HFCausalLM`, which gives it dtrain's
calls: forward(idx, targets) -> (logits, loss) through a `loss_fn` module (tensor
parallelism swaps it for the vocab-parallel loss), pipeline stages for the Llama family
(Llama, Mistral, Qwen2, Mixtral, Qwen3-MoE) and GPT-2, the chunked loss for the same
families (dtrain.models.chunked_loss: their logits are `lm_head` on the base model's
output; another model type keeps the plain loss), and `after_split` for tensor
parallelism.

Mixtral's and Qwen3-MoE's sparse blocks become dtrain's MoE layer (dtrain.models.moe)
holding the same parameters under the same names: it computes what theirs does (softmax
top-k routing, dropless), with grouped expert products instead of a Python loop over
experts, and splits over an expert-parallel group (`parallel.ep`) like dtrain's Llama.
DeepSeek-V3's (`DeepseekV3ForCausalLM`) do too: its grouped sigmoid router with its
correction bias (which dtrain's layer then moves toward even load after every step, as
DeepSeek-V3 trained it; transformers leaves it still), its routed scaling and its shared
experts; its latent attention stays transformers'.

Attention is SDPA: without a mask it is causal, so the pipeline's stages call the blocks
with `attention_mask=None`. GPT-2's `Conv1D` layers (an nn.Linear with its weight stored
[in, out]) become nn.Linear at build time, so tensor-parallel styles apply to them like any
Linear; `transposed` names those weights, which GPT-2's own files keep transposed.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dtrain.context_parallel import ContextParallel, positions_of
from dtrain.errors import ConfigError
from dtrain.models.chunked_loss import CrossEntropy, chunked_loss
from dtrain.models.config import ModelConfig
from dtrain.models.hf_places import HFName, expert_places
from dtrain.models.kv_cache import KVCache
from dtrain.models.moe import MoE, MoEConfig
from dtrain.models.rows import PackedDocuments, weighted

if TYPE_CHECKING:  # transformers is optional: imported where arch "hf" needs it
    from transformers import PretrainedConfig, PreTrainedModel


class Family(enum.Enum):
    """Model layouts whose parts dtrain knows, for cutting them into pipeline stages."""

    ROTARY = "rotary"  # model.embed_tokens, model.layers, model.norm, model.rotary_emb
    GPT2 = "gpt2"  # transformer.wte/wpe/drop, transformer.h, transformer.ln_f


FAMILIES = {"llama": Family.ROTARY, "mistral": Family.ROTARY, "qwen2": Family.ROTARY,
            "mixtral": Family.ROTARY, "qwen3_moe": Family.ROTARY, "deepseek_v3": Family.ROTARY,
            "gpt2": Family.GPT2}
"""Hugging Face model_type -> the family whose pipeline stages dtrain knows."""

ROTARY_FAMILY = tuple(t for t, family in FAMILIES.items() if family is Family.ROTARY)
"""The model types of the Llama family (rotary positions, the attention interface)."""

SPARSE_BLOCKS = {"mixtral": "MixtralSparseMoeBlock", "qwen3_moe": "Qwen3MoeSparseMoeBlock",
                 "deepseek_v3": "DeepseekV3MoE"}
"""Hugging Face model_type -> the class of its sparse MoE blocks, which dtrain swaps for its
own MoE layer of the same parameters."""


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _config_file(cfg: ModelConfig) -> tuple[str, Path]:
    """(the key that names the config, the config.json it names)."""
    key, value = ("hf_config", cfg.hf_config) if cfg.hf_config else ("init_from", cfg.init_from)
    if not value:
        raise ConfigError("model.arch = \"hf\" needs model.hf_config (a Hugging Face config.json "
                          "or a folder holding one) or model.init_from (a model folder)")
    path = Path(value)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"model.{key} = {value!r}: {file} does not exist: give a Hugging Face "
                          "config.json or a folder holding one")
    return key, file


def _transformers() -> ModuleType:
    try:
        import transformers
    except ImportError:
        raise ConfigError("model.arch = \"hf\" needs Hugging Face transformers: "
                          "pip install 'dtrain[hf]'") from None
    return transformers


def _read_json(key: str, file: Path) -> object:
    try:
        return json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"model.{key}: {file} is not JSON ({_one_line(exc)}): give a "
                          "Hugging Face config.json") from None


def _config_of(key: str, file: Path | str, data: object) -> PretrainedConfig:
    """The transformers config of `data` (read from `file`), without running any code
    from the Hub."""
    transformers = _transformers()
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ConfigError(f"model.{key}: {file} has no \"model_type\": give a Hugging Face "
                          "config.json")
    model_type = data["model_type"]
    if model_type not in transformers.CONFIG_MAPPING:
        raise ConfigError(f"model.{key}: transformers {transformers.__version__} does not know "
                          f"model_type {model_type!r} ({file}): use a model type it ships "
                          "(dtrain runs no code from the Hub)")
    data = {k: v for k, v in data.items() if k != "auto_map"}  # remote code: never run
    try:
        return transformers.CONFIG_MAPPING[model_type].from_dict(data)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise ConfigError(f"model.{key}: transformers rejects {file}: "
                          f"{_one_line(exc)}") from None


def _causal_lm_class(key: str, file: Path | str, config: PretrainedConfig) -> type:
    """The causal-LM class transformers builds for `config`.

    BERT-like encoders also have an LM-head class in that mapping, but only as a decoder
    (`is_decoder = true`); as they are, they attend both ways."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    model_type = config.model_type
    encoder = (model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES
               and not getattr(config, "is_decoder", False))
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING or encoder:
        what = "an encoder" if encoder else "not a causal LM in transformers"
        raise ConfigError(f"model.{key}: model_type {model_type!r} ({file}) is {what}: arch "
                          "\"hf\" needs a causal LM (e.g. llama, mistral, qwen2, gpt2)")
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def _check_shape(cfg: ModelConfig, key: str, file: Path | str,
                 config: PretrainedConfig) -> None:
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and vocab < cfg.vocab_size:
        raise ConfigError(f"model.{key}: vocab_size = {vocab} in {file} is smaller than the "
                          f"data's {cfg.vocab_size} token ids: use a config with vocab_size >= "
                          f"{cfg.vocab_size}, or data with a smaller vocabulary")
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and cfg.block_size > positions:
        name = config.attribute_map.get("max_position_embeddings", "max_position_embeddings")
        raise ConfigError(f"model.block_size = {cfg.block_size} exceeds {name} = {positions} "
                          f"in {file}: lower model.block_size to at most {positions}")


def build_hf(cfg: ModelConfig, saved: dict[str, Any] | None = None) -> HFCausalLM:
    """The causal LM of `cfg.hf_config` (a config.json or its folder; when empty, the
    config.json in `cfg.init_from`), or of `saved` (the config as a dict, as a checkpoint
    records it), randomly initialized from torch's current RNG in float32 with SDPA
    attention (eager for a model without it); its dropout probabilities are the config's.
    Weights from `init_from` are not loaded here.

    Raises:
        ConfigError: no config named, the file missing or not JSON, a model type
            transformers does not know or that is not a causal LM, a vocabulary smaller than
            `cfg.vocab_size`, or `cfg.block_size` beyond the model's positions.
    """
    transformers = _transformers()
    if saved is None:
        key, file = _config_file(cfg)
        data = _read_json(key, file)
    else:
        key, file, data = "hf_config", "the checkpoint's record of it", saved
    config = _config_of(key, file, data)
    model_class = _causal_lm_class(key, file, config)
    _check_shape(cfg, key, file, config)
    attention = "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"
    try:
        hf = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation=attention, dtype=torch.float32, trust_remote_code=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model.{key}: transformers cannot build {file}: "
                          f"{_one_line(exc)}") from None
    return HFCausalLM(hf, cfg.block_size)


LATENT_ATTENTION = ("deepseek_v3",)
"""Hugging Face model types whose attention is multi-head latent attention (no q, k and v
projections: tensor and context parallelism do not split it yet)."""


def moe_config_of(config: PretrainedConfig) -> MoEConfig:
    """dtrain's MoE layer computing a Mixtral, Qwen3-MoE or DeepSeek-V3 sparse block of
    `config` (DeepSeek-V3's: a grouped sigmoid router with its shared experts)."""
    deepseek = config.model_type == "deepseek_v3"
    return MoEConfig(n_experts=getattr(config, "num_local_experts", None) or config.num_experts,
                     experts_per_token=config.num_experts_per_tok,
                     hidden=getattr(config, "moe_intermediate_size", None)
                     or config.intermediate_size,
                     norm_topk_prob=bool(getattr(config, "norm_topk_prob", True)),
                     router="sigmoid_bias" if deepseek else "softmax_topk",
                     n_shared_experts=config.n_shared_experts if deepseek else 0,
                     n_group=config.n_group if deepseek else 1,
                     topk_group=config.topk_group if deepseek else 1)


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json of the Hugging Face model `cfg` names, as a dict (empty when it is
    not a JSON object).

    Raises:
        ConfigError: no config named, or the file missing or not JSON.
    """
    data = _read_json(*_config_file(cfg))
    return data if isinstance(data, dict) else {}


def hf_experts(cfg: ModelConfig) -> int:
    """The routed experts per MoE layer of the Hugging Face model `cfg` names (0: a dense
    model, or one whose MoE blocks dtrain does not know), read from its config.json.

    Raises:
        ConfigError: no config named, or the file missing or not JSON.
    """
    data = hf_config_dict(cfg)
    if data.get("model_type") not in SPARSE_BLOCKS:
        return 0
    return int(data.get("num_local_experts") or data.get("num_experts")
               or data.get("n_routed_experts") or 0)


def _swap_moe(hf: nn.Module) -> None:
    """Replace each sparse MoE block of a Mixtral, Qwen3-MoE or DeepSeek-V3 model by
    dtrain's MoE layer holding the same parameters (router weight, stacked experts;
    DeepSeek-V3's correction bias and shared experts) under the same names.

    Raises:
        ConfigError: Mixtral's router jitter, which dtrain's router does not add.
    """
    config = hf.config
    block_class = SPARSE_BLOCKS.get(config.model_type)
    if block_class is None:
        return
    if getattr(config, "router_jitter_noise", 0):
        raise ConfigError(f"model.hf_config: router_jitter_noise = {config.router_jitter_noise} "
                          "is not supported by dtrain's MoE layer: set it to 0")
    moe_cfg = moe_config_of(config)
    for layer in hf.model.layers:
        block = layer.mlp
        if type(block).__name__ != block_class:
            continue  # a dense MLP (Qwen3-MoE's mlp_only_layers)
        with torch.device(block.gate.weight.device):
            moe = MoE(moe_cfg, config.hidden_size)
        moe.gate.weight = block.gate.weight
        moe.experts.gate_up_proj = block.experts.gate_up_proj
        moe.experts.down_proj = block.experts.down_proj
        if config.model_type == "deepseek_v3":
            _take_deepseek_parts(moe, block, config)
        layer.mlp = moe


def _take_deepseek_parts(moe: MoE, block: nn.Module, config: PretrainedConfig) -> None:
    """What a DeepSeek-V3 block adds: its router's correction bias (a buffer there, a
    parameter without gradient here, moved by the load after each step), its routed
    scaling, and its shared experts' weights."""
    moe.gate.expert_bias = nn.Parameter(block.gate.e_score_correction_bias.detach(),
                                        requires_grad=False)
    moe.gate.scale = float(config.routed_scaling_factor)
    if moe.shared is not None:
        shared = block.shared_experts
        moe.shared.gate.weight = shared.gate_proj.weight
        moe.shared.up.weight = shared.up_proj.weight
        moe.shared.down.weight = shared.down_proj.weight


def _linear_of(conv: nn.Module) -> nn.Linear:
    """An nn.Linear computing what a transformers Conv1D does (its weight transposed)."""
    linear = nn.Linear(conv.nx, conv.nf, bias=conv.bias is not None, device="meta")
    linear.weight = nn.Parameter(conv.weight.detach().t().contiguous(),
                                 requires_grad=conv.weight.requires_grad)
    if conv.bias is not None:
        linear.bias = conv.bias
    return linear


def _convert_conv1d(root: nn.Module, prefix: str) -> set[str]:
    """Replace every Conv1D under `root` by its nn.Linear; the names of their weights."""
    from transformers.pytorch_utils import Conv1D

    converted = set()
    for name, module in list(root.named_modules()):
        if isinstance(module, Conv1D):
            parent, _, child = name.rpartition(".")
            setattr(root.get_submodule(parent), child, _linear_of(module))
            converted.add(f"{prefix}{name}.weight")
    return converted


HF_DOCUMENTS = "dtrain_documents"
"""The keyword that tells dtrain's context-parallel attention (dtrain.models.context) that
transformers' position_ids are packed documents' own."""


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM (the submodule `hf`) returning logits, or (logits, loss)
    given next-token targets.

    Args:
        hf: the transformers model (…ForCausalLM); its Conv1D layers become nn.Linear.
        block_size: the longest sequence it will see (dtrain's `[model] block_size`).
    """

    def __init__(self, hf: PreTrainedModel, block_size: int) -> None:
        super().__init__()
        self.hf = hf
        self.block_size = block_size
        # Parameter names ("hf....weight") whose Hugging Face tensor is this one transposed.
        self.transposed: set[str] = _convert_conv1d(hf, "hf.")
        _swap_moe(hf)
        self.family: Family | None = FAMILIES.get(hf.config.model_type)
        # a module, so tensor parallelism can swap it
        self.loss_fn: nn.Module = CrossEntropy()
        self.loss_chunk = 0  # tokens per chunk of the loss (dtrain.models.chunked_loss)
        self.context: ContextParallel | None = None  # dtrain.models.context.apply sets it
        self.kv_cache: KVCache | None = None  # dtrain.models.generate.attach sets it
        self.documents: PackedDocuments | None = None  # the last forward's packed documents
        self.train()

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None,
        positions: torch.Tensor | None = None, weight: float | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor | None, torch.Tensor]:
        """Logits, or (logits, loss) with targets ((None, loss) under the chunked loss:
        the base model's final hidden states through the head chunk by chunk,
        dtrain.models.chunked_loss); `positions` and `weight` as dtrain's own models take
        them (dtrain.models.stages.StagedLM.forward): packed documents are given to
        transformers as their `position_ids` and a 4-D block-causal mask."""
        # No labels: transformers would shift them, and dtrain's targets are already the
        # next tokens.
        self.use_documents(positions)
        where = self._where(idx.shape[1], idx.device)
        if self.kv_cache is not None:  # generation: transformers' own cache, kept in ours
            if self.kv_cache.hf is None:
                self.kv_cache.hf = _transformers().DynamicCache()
            return self.hf(input_ids=idx, past_key_values=self.kv_cache.hf,
                           use_cache=True).logits
        if targets is not None and self.loss_chunk:
            # the families' logits are lm_head(base model's output): FAMILIES, output_head
            hidden = self.hf.base_model(input_ids=idx, use_cache=False, **where)[0]
            loss = chunked_loss(self, hidden, targets)
            # finite without targets (0), so it carries its own zero where the weight is 0
            return None, weighted(loss, weight, loss)
        logits = self.hf(input_ids=idx, use_cache=False, **where).logits
        if targets is None:
            return logits
        loss = self.loss_fn(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, weighted(loss, weight, logits)

    def use_documents(self, positions: torch.Tensor | None) -> None:
        """Make the next forwards (or pipeline stages) run rows of packed documents at
        `positions` (None: one sequence per row).

        Raises:
            DtrainError: documents with a KV cache (generation runs one sequence).
        """
        self.documents = PackedDocuments.given(positions, self.context is not None,
                                               self.kv_cache is not None)

    def _where(self, t: int, device: torch.device) -> dict[str, torch.Tensor | bool]:
        """What transformers is told of the positions: this rank's chunks' global ones
        under context parallelism; of packed documents, their own and their mask (under
        context parallelism, their own, which dtrain's attention reads: `HF_DOCUMENTS`)."""
        if self.documents is not None:
            if self.context is not None:
                return {"position_ids": self.documents.positions, HF_DOCUMENTS: True}
            assert self.documents.mask is not None  # built without context parallelism
            return {"position_ids": self.documents.positions,
                    "attention_mask": self.documents.mask}
        if self.context is not None:
            return {"position_ids": self.context.positions(t, device)[None]}
        return {}

    def after_split(self, tp_size: int) -> None:
        """Fix what counts whole heads once tensor parallelism has split the layers across
        `tp_size` ranks (dtrain.tensor_parallel.plan_of.split_model calls it).

        GPT-2's attention cuts its fused QKV output into Q, K and V by `split_size` (the
        whole width): a rank holds `1/tp_size` of each, so that becomes width / tp_size,
        and `num_heads` the heads it holds. The Llama family needs nothing: its reshapes
        count heads with -1 and its key/value groups are a ratio tensor parallelism keeps.
        """
        if self.family is not Family.GPT2:
            return
        config = self.hf.config
        for block in self.hf.transformer.h:
            block.attn.split_size = config.n_embd // tp_size
            block.attn.num_heads = config.n_head // tp_size

    # How the pipeline cuts it (dtrain.models.Stages).
    def stage_parts(self) -> tuple[list[str], str, list[str]]:
        config = self.hf.config
        if self.family is None:
            raise ConfigError(f"pipeline stages for model type {config.model_type!r} are not "
                              f"known: dtrain cuts {', '.join(FAMILIES)}; use pp = 1, or give "
                              "your own module the Stages methods (arch = \"custom\")")
        window = getattr(config, "sliding_window", None)
        if window is not None and window < self.block_size:
            raise ConfigError(f"pipeline stages of {config.model_type!r} attend causally over "
                              f"the whole block, but its sliding_window = {window} is shorter "
                              f"than model.block_size = {self.block_size}: lower block_size "
                              "to the window or use pp = 1")
        if self.family is Family.ROTARY:
            return ["hf.model.embed_tokens"], "hf.model.layers", ["hf.model.norm", "hf.lm_head"]
        return (["hf.transformer.wte", "hf.transformer.wpe", "hf.transformer.drop"],
                "hf.transformer.h", ["hf.transformer.ln_f", "hf.lm_head"])

    def stage_in(self, idx: torch.Tensor) -> torch.Tensor:
        if self.family is Family.ROTARY:
            return self.hf.model.embed_tokens(idx)
        body = self.hf.transformer
        positions = self._where(idx.shape[1], idx.device).get("position_ids")
        if positions is None:
            positions = positions_of(None, idx.shape[1], idx.device)
        return body.drop(body.wte(idx) + body.wpe(positions))

    def stage_block(self, block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        where = self._where(h.shape[1], h.device)
        mask = where.pop("attention_mask", None)
        if self.family is Family.ROTARY:
            positions = where.get("position_ids")
            if positions is None:
                positions = positions_of(None, h.shape[1], h.device)[None]
            rotary = self.hf.model.rotary_emb(h, positions)
            out = block(h, attention_mask=mask, position_embeddings=rotary,
                        **{**where, "position_ids": positions})
        else:
            out = block(h, attention_mask=mask)
        return out[0] if isinstance(out, tuple) else out  # older transformers return tuples

    def stage_out(self, h: torch.Tensor) -> torch.Tensor:
        return self.hf.lm_head(self.final_hidden(h))

    # How the chunked loss reaches the logits (dtrain.models.chunked_loss.ChunkableLM).
    def final_hidden(self, h: torch.Tensor) -> torch.Tensor:
        norm = self.hf.model.norm if self.family is Family.ROTARY else self.hf.transformer.ln_f
        return norm(h)

    def output_head(self) -> nn.Module | None:
        """`lm_head` for the families dtrain knows, whose logits are it on the base model's
        output (no scaling or soft-capping after it); None for the others."""
        return self.hf.lm_head if self.family is not None else None


def hf_names(model: HFCausalLM) -> dict[str, tuple[HFName, bool]]:
    """dtrain parameter name (as `model.named_parameters()` gives it: a tied head is not
    listed) -> (where the tensor lives in a Hugging Face folder, whether it is stored
    transposed there: GPT-2's Conv1D weights). A MoE layer's tensors are where Mixtral's,
    Qwen3-MoE's and DeepSeek-V3's files keep them (dtrain.models.hf_places.expert_places)."""
    names: dict[str, tuple[HFName, bool]] = {
        name: (name.removeprefix("hf."), name in model.transposed)
        for name, _ in model.named_parameters()}
    model_type = model.hf.config.model_type
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            layer = name.removeprefix("hf.").removesuffix(".mlp")
            places = expert_places(model_type, layer, module.cfg.n_experts,
                                   module.shared is not None)
            for ours, place in places.items():
                names[f"{name}.{ours}"] = (place, False)
    return names
