"""`dtrain export CKPT OUT --format hf`: a checkpoint as a Hugging Face model folder.

OUT gets `config.json` and `model.safetensors` (and `tokenizer.json` when the run used a
tokenizer file), which `transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads and
which gives the logits dtrain's model gives. dtrain's Llama becomes a Hugging Face Llama,
dtrain's GPT a GPT-2 (with exact GELU), and a Hugging Face model its own type again.
The folder appears whole or not at all.
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

from dtrain.checkpoint.universal import MODEL, Checkpoint
from dtrain.errors import ConfigError, DtrainError
from dtrain.models import ModelConfig, hf_names
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


def export_hf(path: str | Path, out: str | Path, also: Sequence[str | Path] = ()) -> Path:
    """Write the model of the checkpoint at `path` as a Hugging Face folder `out`; `also`:
    other hosts' folders holding the files `path` lacks (dtrain.checkpoint.universal.
    Checkpoint).

    Raises:
        ConfigError: `out` exists and is not empty, or the model has no such format.
        DtrainError: not a checkpoint, or a damaged one.
    """
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"dtrain export: {out} exists and is not empty: remove it or "
                          "choose another folder")
    ckpt = Checkpoint(path, also)
    hf_config, names = hf_format(ckpt)
    state = hf_state(names, lambda name: ckpt.tensor(MODEL + name))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, default=str))
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer = ckpt.meta.get("tokenizer")
        if tokenizer:
            if not Path(tokenizer).exists():
                raise DtrainError(f"dtrain export: the run's tokenizer {tokenizer} is gone: "
                                  "the folder would lack it")
            shutil.copyfile(tokenizer, tmp / "tokenizer.json")
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
