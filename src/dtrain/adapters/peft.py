"""LoRA adapters in PEFT's format: a folder of `adapter_config.json` and
`adapter_model.safetensors`, which `peft.PeftModel.from_pretrained(base, folder)` loads
onto the Hugging Face form of the base.

    dtrain export runs/lora/checkpoints my-adapter/ --format peft     # written (tools)
    [model] init_from = "my-adapter/"                                 # read back

PEFT names a tensor by the Hugging Face module it adapts:
`base_model.model.<module>.lora_A.weight`. A dtrain layer's module there is the one
holding its weight in the Hugging Face form (dtrain.models.hf_names): the same name for
`arch = "hf"` (less the `hf.` prefix), `model.layers.0.mlp.gate_proj` for dtrain Llama's
`blocks.0.mlp.gate`, `transformer.h.0.attn.c_attn` for dtrain GPT's fused
`blocks.0.attn.qkv` (GPT-2's Conv1D keeps its weight transposed, which PEFT's
`fan_in_fan_out` says; A and B are the same). A layer with no such module is refused.

Reading a folder (`PeftFolder`): the base is its `base_model_name_or_path`, a local folder;
the adapters start from its tensors. `[adapter]` keys left at their defaults take the
folder's values (rank r, alpha lora_alpha, dropout lora_dropout, the layers it adapts);
a key set to something else is refused, naming both.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from dtrain.adapters.config import AdapterConfig
from dtrain.adapters.lora import LoRAFactor, adapters, apply
from dtrain.errors import ConfigError
from dtrain.models import build, hf_names, init
from dtrain.models.config import ModelConfig
from dtrain.models.hf_places import HFName
from dtrain.models.weights import HFWeights

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
"""PEFT's prefix of a causal LM's module names in its files."""
FACTORS = ("lora_A", "lora_B")


def hf_layers(names: dict[str, tuple[HFName, bool]], layers: list[str]
              ) -> dict[str, tuple[str, bool]]:
    """dtrain layer name -> (its module in the Hugging Face model, whether its weight is
    stored transposed there), for `layers` (linear layers), through `names` (dtrain
    parameter -> Hugging Face tensor, dtrain.models.hf_names).

    Raises:
        ConfigError: a layer whose weight has no tensor of its own there.
    """
    out = {}
    for layer in layers:
        where, transposed = names.get(f"{layer}.weight", (None, False))
        if not isinstance(where, str) or not where.endswith(".weight"):
            raise ConfigError(f"the adapted layer {layer} has no one-to-one layer in the "
                              "Hugging Face model: PEFT's format cannot name its adapters "
                              "(export the adapters with OUT ending in .safetensors)")
        out[layer] = (where.removesuffix(".weight"), transposed)
    return out


def peft_key(module: str, factor: str) -> str:
    """The name PEFT's files give the adapter `factor` (lora_A, lora_B) of `module`."""
    return f"{PREFIX}{module}.{factor}.weight"


def target_modules(adapted: list[str], modules: list[str]) -> list[str]:
    """PEFT's target_modules for the Hugging Face modules `adapted`, out of the model's
    linear `modules`: their last name parts when those name no other module, else the
    modules' whole names."""
    short = sorted({m.rpartition(".")[2] for m in adapted})
    matched = {m for m in modules if m.rpartition(".")[2] in short}
    return short if matched == set(adapted) else sorted(adapted)


def adapter_config(adapter: AdapterConfig, targets: list[str], base: str | None,
                   fan_in_fan_out: bool) -> dict[str, Any]:
    """The adapter_config.json of adapters of `adapter`'s size on `targets`."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": adapter.rank, "lora_alpha": adapter.alpha, "lora_dropout": adapter.dropout,
            "target_modules": targets, "fan_in_fan_out": fan_in_fan_out, "bias": "none",
            "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "init_lora_weights": True, "rank_pattern": {}, "alpha_pattern": {},
            "inference_mode": True, "revision": None}


UNSUPPORTED = {"use_rslora": False, "use_dora": False, "bias": "none", "modules_to_save": None,
               "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None,
               "target_parameters": None, "lora_bias": False}
"""adapter_config.json keys whose other values dtrain's LoRA does not compute."""


@dataclasses.dataclass
class PeftFolder:
    """A PEFT LoRA folder read for `model.init_from` (see the module doc).

    Raises (`read`):
        ConfigError: not LoRA, settings dtrain's LoRA does not compute, no weights file,
            or a base that is not a local folder.
    """

    path: Path
    config: dict[str, Any]
    base: str
    modules: list[str]
    """The Hugging Face modules its tensors adapt."""

    @classmethod
    def read(cls, folder: str | Path) -> PeftFolder | None:
        """The PEFT folder `folder`, or None when it holds no adapter_config.json."""
        path = Path(folder)
        if not (path / CONFIG).is_file():
            return None
        where = f"model.init_from = {str(folder)!r}"
        try:
            config = json.loads((path / CONFIG).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{where}: {CONFIG} is not JSON ({exc})") from None
        if not isinstance(config, dict) or config.get("peft_type") != "LORA":
            kind = config.get("peft_type") if isinstance(config, dict) else None
            raise ConfigError(f"{where} is a PEFT folder of peft_type {kind!r}: dtrain reads "
                              "LoRA adapters (peft_type \"LORA\")")
        for key, value in UNSUPPORTED.items():
            if config.get(key) not in (None, value, [], {}):
                raise ConfigError(f"{where}: {CONFIG} sets {key} = {config[key]!r}, which "
                                  f"dtrain's LoRA does not compute (it needs {value!r})")
        if not (path / WEIGHTS).is_file():
            raise ConfigError(f"{where} holds no {WEIGHTS}: save the adapters with "
                              "safe_serialization (PEFT's default)")
        with safe_open(str(path / WEIGHTS), framework="pt") as f:
            keys = list(f.keys())
        modules = sorted({k.removeprefix(PREFIX).rsplit(".", 2)[0] for k in keys
                          if k.endswith(".lora_A.weight")})
        if not modules:
            raise ConfigError(f"{where}: {WEIGHTS} holds no LoRA tensors of a causal LM "
                              f"(names {PREFIX}...lora_A.weight)")
        unread = [k for k in keys if not k.startswith(PREFIX)
                  or not k.endswith((".lora_A.weight", ".lora_B.weight"))]
        if unread:
            raise ConfigError(f"{where}: {WEIGHTS} holds {unread[0]}, which dtrain's LoRA of "
                              "linear layers does not read: give a folder of LoRA adapters "
                              "on linear layers")
        return cls(path, config, cls._base_of(path, config.get("base_model_name_or_path")),
                   modules)

    @staticmethod
    def _base_of(path: Path, base: object) -> str:
        """The local folder of the base: as written, or relative to the PEFT folder."""
        if isinstance(base, str) and base:
            for candidate in (Path(base), path / base):
                if (candidate / "config.json").is_file():
                    return str(candidate)
        raise ConfigError(f"model.init_from = {str(path)!r} is a PEFT folder whose "
                          f"base_model_name_or_path = {base!r} is not a local model folder: "
                          f"set it in {path / CONFIG} to the base model's folder")

    def adapter_config(self, cfg: AdapterConfig, shape: ModelConfig) -> AdapterConfig:
        """`cfg` (the run's `[adapter]`) with the folder's settings for keys left at their
        defaults; the layers adapted are the folder's, by their names in the model of
        `shape` (the base: `shape.init_from` is its folder).

        Raises:
            ConfigError: a key set to another value than the folder's, or a layer the
                folder adapts that the model lacks.
        """
        plain = init.skeleton(lambda: build(shape))
        linears = [n for n, m in plain.named_modules()
                   if isinstance(m, nn.Linear) and not isinstance(m, LoRAFactor) and n]
        ours_of = {module: layer for layer, (module, _) in
                   _mappable(hf_names(shape, plain), linears).items()}
        lacking = [m for m in self.modules if m not in ours_of]
        if lacking:
            raise ConfigError(f"model.init_from = {str(self.path)!r} adapts {lacking[0]}, "
                              "which the base model has no linear layer for: is "
                              f"base_model_name_or_path ({self.base}) the base of [model]?")
        theirs = sorted(ours_of[m] for m in self.modules)
        adopted = AdapterConfig(kind="lora", rank=int(self.config["r"]),
                                alpha=float(self.config.get("lora_alpha", 8)),
                                dropout=float(self.config.get("lora_dropout", 0.0)),
                                targets=theirs, init=cfg.init)
        default = AdapterConfig()
        for key, name in (("rank", "r"), ("alpha", "lora_alpha"), ("dropout", "lora_dropout")):
            mine, folder = getattr(cfg, key), getattr(adopted, key)
            if mine != getattr(default, key) and mine != folder:
                raise ConfigError(f"adapter.{key} = {mine} but {self.path / CONFIG} has "
                                  f"{name} = {folder}: leave adapter.{key} out to take it, or "
                                  "set it the same")
        if cfg.targets:
            chosen = apply(plain, cfg, shape.arch)
            if set(chosen) != set(theirs):
                extra = sorted(set(chosen) - set(theirs)) or sorted(set(theirs) - set(chosen))
                side = "not in" if set(chosen) - set(theirs) else "only in"
                raise ConfigError(f"adapter.targets = {cfg.targets} adapts {len(chosen)} layers "
                                  f"and {self.path} {len(theirs)} ({extra[0]} is {side} "
                                  "adapter.targets' choice): leave adapter.targets out to take "
                                  "the folder's layers")
        return adopted

    def weights(self, shape: ModelConfig, model: nn.Module) -> HFWeights:
        """The folder's adapter tensors by their dtrain names, for the adapted layers of
        `model` (a skeleton built from `shape`, adapted as `adapter_config` says)."""
        layers = hf_layers(hf_names(shape, model), list(adapters(model)))
        names: dict[str, tuple[HFName, bool]] = {
            f"{layer}.{factor}.weight": (peft_key(module, factor), False)
            for layer, (module, _) in layers.items() for factor in FACTORS}
        return HFWeights(self.path, names, file=WEIGHTS)


def _mappable(names: dict[str, tuple[HFName, bool]], layers: list[str]
              ) -> dict[str, tuple[str, bool]]:
    """`hf_layers` of those `layers` that have a Hugging Face module."""
    out = {}
    for layer in layers:
        try:
            out.update(hf_layers(names, [layer]))
        except ConfigError:
            continue
    return out


def linear_modules(names: dict[str, tuple[HFName, bool]]) -> list[str]:
    """The Hugging Face modules holding a `weight` of their own in `names`' model (PEFT's
    target_modules match among them)."""
    return sorted({where.removesuffix(".weight") for where, _ in names.values()
                   if isinstance(where, str) and where.endswith(".weight")})


def peft_state(layers: dict[str, tuple[str, bool]], tensor_of: Callable[[str], torch.Tensor]
               ) -> dict[str, torch.Tensor]:
    """PEFT's tensors of the adapted `layers` (dtrain layer -> (Hugging Face module,
    transposed)), `tensor_of(dtrain parameter name)` giving each adapter factor."""
    return {peft_key(module, factor): tensor_of(f"{layer}.{factor}.weight").contiguous().clone()
            for layer, (module, _) in layers.items() for factor in FACTORS}
