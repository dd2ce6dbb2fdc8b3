"""`dtrain export CKPT OUT --format hf`: a checkpoint as a Hugging Face model folder.

OUT gets `config.json` and `model.safetensors` (and `tokenizer.json` when the run used a
tokenizer file), which `transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads and
which gives the logits dtrain's model gives. dtrain's Llama becomes a Hugging Face Llama,
dtrain's GPT a GPT-2 (with exact GELU), and a Hugging Face model its own type again.
The folder appears whole or not at all (`write_folder`).

With `--merge`, a checkpoint of LoRA adapters (dtrain.adapters) becomes the merged model:
each adapted weight W + B A * alpha / rank, the base rebuilt from where it came from (the
folder `init_from`, checked to be the one trained on, or the seed). An adapter checkpoint
without `--merge` is refused: it holds no whole model (`--format peft` writes the adapters
alone, dtrain.tools.export_peft).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dtrain import adapters
from dtrain.adapters import AdapterConfig, checkpoints
from dtrain.checkpoint.universal import MODEL, Checkpoint
from dtrain.errors import ConfigError, DtrainError
from dtrain.models import ModelConfig, hf_names, init
from dtrain.models.hf_places import HFName, Stacked, Zeros


def _model_of(ckpt: Checkpoint) -> ModelConfig:
    saved = ckpt.meta.get("model")
    if saved is None:
        raise ConfigError(f"checkpoint {ckpt.path} does not record its resolved model (saved "
                          "by an older dtrain): export it with OUT ending in .safetensors")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in saved.items() if k in fields})


def hf_format(ckpt: Checkpoint) -> tuple[dict[str, Any], dict[str, tuple[HFName, bool]]]:
    """The Hugging Face config of the checkpoint's model, and its parameter names there
    (dtrain name -> (Hugging Face name, transposed)).

    Raises:
        ConfigError: a custom model (it has no Hugging Face format).
    """
    cfg = _model_of(ckpt)
    if cfg.arch == "custom":
        raise ConfigError("a custom model has no Hugging Face format: export it with OUT "
                          "ending in .safetensors (a plain state_dict)")
    if cfg.arch != "hf":
        from dtrain.models.convert import hf_config_of

        return hf_config_of(cfg), hf_names(cfg)
    from dtrain.models.hf import build_hf

    with torch.device("meta"):
        model = build_hf(cfg, saved=ckpt.meta["hf_config"])
    return ckpt.meta["hf_config"], hf_names(cfg, model)


def hf_state(names: dict[str, tuple[HFName, bool]],
             tensor_of: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict of a model whose dtrain tensors `tensor_of(name)` gives,
    through `names` (dtrain name -> (Hugging Face name, transposed)): stacked experts
    split into a tensor per expert, tensors Hugging Face has no place for left out.

    Raises:
        ConfigError: such a tensor is not zero (a sigmoid_bias router's bias has moved: no
            Hugging Face model of this kind computes it).
    """
    state = {}
    for name, (where, transposed) in names.items():
        tensor = tensor_of(name)
        if isinstance(where, Zeros):
            if tensor.any():
                raise ConfigError(f"{name} is not zero and the Hugging Face model has no place "
                                  "for it: export with OUT ending in .safetensors")
        elif isinstance(where, Stacked):
            state.update(where.split(tensor))
        else:
            state[where] = (tensor.t() if transposed else tensor).contiguous().clone()
    return state


def lora_layers(ckpt: Checkpoint) -> list[str]:
    """The layers whose LoRA adapters `ckpt` holds (dtrain names)."""
    return sorted(n.removesuffix(".lora_A.weight") for n in ckpt.names(MODEL)
                  if n.endswith(".lora_A.weight"))


def adapter_of(ckpt: Checkpoint) -> AdapterConfig:
    """The `[adapter]` section the checkpoint's run trained with."""
    saved = ckpt.meta.get("config", {}).get("adapter", {})
    fields = {f.name for f in dataclasses.fields(AdapterConfig)}
    return AdapterConfig(**{k: v for k, v in saved.items() if k in fields})


def skeleton_of(ckpt: Checkpoint) -> tuple[ModelConfig, torch.nn.Module]:
    """The resolved model of `ckpt` and a skeleton of it with its adapters
    (dtrain.models.init), a Hugging Face model built from the config the checkpoint
    records."""
    cfg, adapter = _model_of(ckpt), adapter_of(ckpt)

    def make() -> torch.nn.Module:
        if cfg.arch != "hf":
            return adapters.built(cfg, adapter)
        from dtrain.models.hf import build_hf

        model = build_hf(cfg, saved=ckpt.meta["hf_config"])
        if adapter.kind == "lora":
            adapters.apply(model, adapter, cfg.arch)
        return model

    return cfg, init.skeleton(make)


def merged(ckpt: Checkpoint, layers: list[str]) -> Callable[[str], torch.Tensor]:
    """name -> the tensor of the merged model: an adapted layer's weight W + B A * alpha /
    rank, the rest as they are (the base of an adapter checkpoint rebuilt beneath it).

    Raises:
        ConfigError: the base is not the one the adapters were trained on.
    """
    shape, model = skeleton_of(ckpt)
    source = checkpoints.checkpoint_weights(ckpt, shape, model)
    adapter = adapter_of(ckpt)
    scaling = adapter.alpha / adapter.rank
    weights = {f"{layer}.weight": layer for layer in layers}

    def tensor_of(name: str) -> torch.Tensor:
        tensor = source.tensor(MODEL + name)
        layer = weights.get(name)
        if layer is None:
            return tensor
        down = source.tensor(f"{MODEL}{layer}.lora_A.weight").float()
        up = source.tensor(f"{MODEL}{layer}.lora_B.weight").float()
        return (tensor.float() + up @ down * scaling).to(tensor.dtype)

    return tensor_of


def export_hf(path: str | Path, out: str | Path, also: Sequence[str | Path] = (),
              merge: bool = False) -> Path:
    """Write the model of the checkpoint at `path` as a Hugging Face folder `out`; `also`:
    other hosts' folders holding the files `path` lacks (dtrain.checkpoint.universal.
    Checkpoint); `merge`: the adapters folded into the weights they adapt.

    Raises:
        ConfigError: `out` exists and is not empty, the model has no such format, an
            adapter checkpoint without `merge`, `merge` of a checkpoint without adapters.
        DtrainError: not a checkpoint, or a damaged one.
    """
    check_new_folder(out)
    ckpt = Checkpoint(path, also)
    layers = lora_layers(ckpt)
    if checkpoints.holds_adapters_alone(ckpt) and not merge:
        raise ConfigError(f"dtrain export: {ckpt.path} holds LoRA adapters without their base: "
                          "add --merge for the whole model with the adapters folded in, or "
                          "use --format peft for the adapters alone")
    if merge and not layers:
        raise ConfigError(f"dtrain export: --merge folds adapters in, and {ckpt.path} holds "
                          "none: drop --merge")
    hf_config, names = hf_format(ckpt)
    tensor_of = merged(ckpt, layers) if merge else (lambda name: ckpt.tensor(MODEL + name))
    state = hf_state(names, tensor_of)
    tokenizer = ckpt.meta.get("tokenizer")

    def fill(folder: Path) -> None:
        (folder / "config.json").write_text(json.dumps(hf_config, indent=2, default=str))
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer:
            if not Path(tokenizer).exists():
                raise DtrainError(f"dtrain export: the run's tokenizer {tokenizer} is gone: "
                                  "the folder would lack it")
            shutil.copyfile(tokenizer, folder / "tokenizer.json")

    return write_folder(out, fill)


def check_new_folder(out: str | Path) -> None:
    """Refuse an output folder that exists and is not empty.

    Raises:
        ConfigError: it does.
    """
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"dtrain export: {out} exists and is not empty: remove it or "
                          "choose another folder")


def write_folder(out: str | Path, fill: Callable[[Path], None]) -> Path:
    """The folder `out`, its files written by `fill(folder)` into a hidden folder beside it
    that is renamed into place once whole: it appears whole or not at all.

    Raises:
        ConfigError: `out` exists and is not empty.
    """
    out = Path(out)
    check_new_folder(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        fill(tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
