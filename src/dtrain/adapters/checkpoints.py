"""Adapter checkpoints: what trains, without the frozen base, and the base's identity.

A run with `[adapter] kind = "lora"` saves the adapters alone (`saved_names`: the
parameters that train, with their optimizer state, and a MoE router's balancing bias,
which moves without a gradient). The base is not saved: it is rebuilt from where it came
from, which the checkpoint's metadata records under "base" (`base_identity`):

    {"init_from": "/abs/my-model", "sha256": "..."}          # the folder's files
    {"init_from": "", "seed": 1337, "sha256": "..."}          # drawn from the seed

The digest is SHA-256 over the folder's config and weight files (sorted by name; each
file read once per process), or over the resolved `[model]` (with a Hugging Face model's
own config) and `train.seed`. Resuming rebuilds the base the same way and reads the
checkpoint over it (`checkpoint_weights`, a dtrain.models.weights.Overlaid), in any
layout; a base whose identity differs is refused in one line (`check_base`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from torch import nn

from dtrain.adapters.lora import adapters, frozen_base
from dtrain.checkpoint.universal import Checkpoint
from dtrain.errors import ConfigError
from dtrain.models import init
from dtrain.models.config import ModelConfig
from dtrain.models.weights import Overlaid, SlicedWeights, weights_of

BASE = "base"
"""The key of an adapter checkpoint's metadata that holds its base's identity."""

FOLDER_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json")
"""The files of a Hugging Face folder whose bytes make a base's identity."""


def adapter_names(model: nn.Module) -> list[str]:
    """The adapters' parameters of `model` (each adapted layer's lora_A and lora_B)."""
    return [f"{layer}.{factor}.weight" for layer in adapters(model)
            for factor in ("lora_A", "lora_B")]


def saved_names(model: nn.Module) -> set[str]:
    """The parameters an adapter checkpoint of `model` holds: all but its frozen base
    (dtrain.adapters.lora.frozen_base): those that train, and each MoE router's balancing
    bias (moved by its rule, not by a gradient)."""
    base = {id(p) for p in frozen_base(model)}
    return {n for n, p in model.named_parameters() if id(p) not in base}


def holds_adapters_alone(ckpt: Checkpoint) -> bool:
    """Whether `ckpt` is an adapter checkpoint (its base left out)."""
    return BASE in ckpt.meta


def _short(digest: str) -> str:
    return digest[:12]


@functools.lru_cache(maxsize=8)
def _files_digest(folder: str, stamp: tuple[tuple[str, int, int], ...]) -> str:
    """SHA-256 over the files `stamp` names (name, size, mtime) in `folder`: each one's
    name, then its bytes (cached while the files are unchanged)."""
    digest = hashlib.sha256()
    for name, _, _ in stamp:
        digest.update(name.encode() + b"\0")
        with open(Path(folder) / name, "rb") as f:
            while block := f.read(1 << 24):
                digest.update(block)
    return digest.hexdigest()


def folder_digest(folder: str | Path) -> str:
    """SHA-256 over a Hugging Face folder's config and weight files (FOLDER_FILES), in
    sorted order.

    Raises:
        ConfigError: the folder is gone or holds none of them.
    """
    path = Path(folder)
    files = sorted({f for pattern in FOLDER_FILES for f in path.glob(pattern) if f.is_file()})
    if not files:
        raise ConfigError(f"model.init_from = {str(folder)!r} holds no config.json or "
                          "safetensors files: give the base model's folder")
    stamp = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _files_digest(str(path.resolve()), stamp)


def base_identity(shape: ModelConfig, seed: int, hf_config: dict[str, Any] | None = None
                  ) -> dict[str, Any]:
    """What the frozen base of a model `shape` (resolved) is: the files of `init_from`, or
    without it the values `seed` draws for that shape (`hf_config`: a Hugging Face model's
    own config, whose path in `shape` may move)."""
    if shape.init_from:
        return {"init_from": str(Path(shape.init_from).resolve()),
                "sha256": folder_digest(shape.init_from)}
    drawn = {k: v for k, v in dataclasses.asdict(shape).items()
             if k not in ("init_from", "hf_config")}
    text = json.dumps({"model": drawn, "hf_config": hf_config, "seed": seed},
                      sort_keys=True, default=str)
    return {"init_from": "", "seed": seed, "sha256": hashlib.sha256(text.encode()).hexdigest()}


def check_base(ckpt: Checkpoint, identity: dict[str, Any] | None) -> None:
    """Refuse to read `ckpt` over a base other than the one its adapters were trained on
    (`identity`, `base_identity`'s; None: the run has no adapters).

    Raises:
        ConfigError: one line naming what differs and what to do.
    """
    saved = ckpt.meta.get(BASE)
    if saved is None:  # a whole model: nothing is rebuilt
        return
    if identity is None:
        raise ConfigError(f"checkpoint {ckpt.path} holds LoRA adapters without their base: "
                          "resume it with [adapter] kind = \"lora\" as it was trained")
    if saved == identity:
        return
    there, here = saved.get("init_from", ""), identity["init_from"]
    start = f"checkpoint {ckpt.path} holds adapters trained on"
    if there and here == there:
        raise ConfigError(f"{start} the files of model.init_from = {there!r} as they were "
                          f"(sha256 {_short(saved['sha256'])}), which have changed since "
                          f"(sha256 {_short(identity['sha256'])}): put the base back, or start "
                          "a new run (another train.out_dir) on this one")
    if there or here:
        what = (f"the folder {there!r}" if there else
                f"a base drawn from train.seed = {saved.get('seed')}")
        now = f"the folder {here!r}" if here else "a base drawn from the seed"
        raise ConfigError(f"{start} {what}, and this run's base is {now}: set model.init_from "
                          "as it was trained, or start a new run (another train.out_dir)")
    if saved.get("seed") != identity["seed"]:
        raise ConfigError(f"{start} a base drawn from train.seed = {saved.get('seed')}, and "
                          f"this run's is drawn from train.seed = {identity['seed']}: set "
                          f"train.seed = {saved.get('seed')} to resume it")
    raise ConfigError(f"{start} a base drawn from another [model] (sha256 "
                      f"{_short(saved['sha256'])} there, {_short(identity['sha256'])} here): "
                      "resume with the [model] it was trained with")


def base_weights(shape: ModelConfig, model: nn.Module, seed: int) -> SlicedWeights:
    """The frozen base of `model` (a skeleton built from `shape`, adapters and all): the
    folder `shape.init_from`, or the initial values for `seed`."""
    if shape.init_from:
        return weights_of(shape, model, without=set(adapter_names(model)))
    return init.Initial(model, seed)


def starting_weights(shape: ModelConfig, model: nn.Module, seed: int,
                     adapters_from: SlicedWeights | None = None) -> SlicedWeights | None:
    """What a new run of the adapted `model` (a skeleton) starts from: its base (the
    folder `shape.init_from`, or the seed's values) beneath the adapters of
    `adapters_from` (a PEFT folder's) or else the seed's initial adapters. None: the
    seed's values for every parameter (dtrain.layouts draws them)."""
    if not shape.init_from and adapters_from is None:
        return None
    over = adapters_from if adapters_from is not None else init.Initial(model, seed)
    return Overlaid(base_weights(shape, model, seed), over, adapter_names(model))


def checkpoint_weights(ckpt: Checkpoint, shape: ModelConfig, model: nn.Module,
                       seed: int | None = None) -> Checkpoint | Overlaid:
    """What `model` (a skeleton of the model `ckpt` holds, built from `shape`) restores
    from: `ckpt` itself, or for an adapter checkpoint its base rebuilt beneath it, once
    the base is checked to be the one it was trained on (`seed`: the run's, default the
    checkpoint's train.seed).

    Raises:
        ConfigError: the base differs (`check_base`), or its folder is gone.
    """
    if not holds_adapters_alone(ckpt):
        return ckpt
    if seed is None:
        seed = ckpt.meta.get("config", {}).get("train", {}).get("seed", 0)
    hf = getattr(model, "hf", None)
    check_base(ckpt, base_identity(shape, seed, hf.config.to_dict() if hf is not None else None))
    return Overlaid(base_weights(shape, model, seed), ckpt)
