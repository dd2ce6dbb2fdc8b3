"""`dtrain export CKPT OUT --format peft`: a checkpoint's LoRA adapters as a PEFT folder.

OUT gets `adapter_config.json` (peft_type LORA, task_type CAUSAL_LM, r, lora_alpha,
lora_dropout, target_modules, base_model_name_or_path: the run's `init_from` folder, or
null for a base drawn from the seed) and `adapter_model.safetensors` (PEFT's names,
dtrain.adapters.peft), which `peft.PeftModel.from_pretrained(base, OUT)` loads onto the
Hugging Face form of the base (`dtrain export --format hf` of it, or the `init_from`
folder) and which gives the logits dtrain's adapted model gives. The folder appears whole
or not at all.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from safetensors.torch import save_file

from dtrain.adapters import checkpoints
from dtrain.adapters.peft import (
    CONFIG,
    WEIGHTS,
    adapter_config,
    hf_layers,
    linear_modules,
    peft_state,
    target_modules,
)
from dtrain.checkpoint.universal import MODEL, Checkpoint
from dtrain.errors import ConfigError
from dtrain.tools.export_hf import (
    adapter_of,
    check_new_folder,
    hf_format,
    lora_layers,
    write_folder,
)


def base_folder(ckpt: Checkpoint) -> str | None:
    """The folder of the checkpoint's base model (absolute), or None when it was drawn
    from the seed."""
    recorded = ckpt.meta.get(checkpoints.BASE, {}).get("init_from")
    if recorded:
        return str(recorded)
    folder = ckpt.meta.get("model", {}).get("init_from")
    return str(Path(folder).resolve()) if folder else None


def export_peft(path: str | Path, out: str | Path, also: Sequence[str | Path] = ()) -> Path:
    """Write the LoRA adapters of the checkpoint at `path` as a PEFT folder `out`; `also`:
    other hosts' folders holding the files `path` lacks.

    Raises:
        ConfigError: `out` exists and is not empty, the checkpoint holds no adapters, or
            an adapted layer has no one-to-one layer in the Hugging Face model.
        DtrainError: not a checkpoint, or a damaged one.
    """
    check_new_folder(out)
    ckpt = Checkpoint(path, also)
    layers = lora_layers(ckpt)
    if not layers:
        raise ConfigError(f"dtrain export: {ckpt.path} holds no LoRA adapters: --format peft "
                          "writes adapters; export the model with --format hf")
    _, names = hf_format(ckpt)
    mapped = hf_layers(names, layers)
    targets = target_modules([module for module, _ in mapped.values()], linear_modules(names))
    config = adapter_config(adapter_of(ckpt), targets, base_folder(ckpt),
                            fan_in_fan_out=any(t for _, t in mapped.values()))
    state = peft_state(mapped, lambda name: ckpt.tensor(MODEL + name))

    def fill(folder: Path) -> None:
        (folder / CONFIG).write_text(json.dumps(config, indent=2))
        save_file(state, str(folder / WEIGHTS), metadata={"format": "pt"})

    return write_folder(out, fill)
