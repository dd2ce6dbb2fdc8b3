"""Adapters: a model's base frozen, small trained matrices beside its layers.

    lora = AdapterConfig(kind="lora", rank=8, alpha=16)
    names = apply(model, lora)          # the adapted layers' names; the base is frozen

- `config.py`: the `[adapter]` section.
- `lora.py`: LoRA (Hu et al., 2021): `LoRALinear`, each adapted nn.Linear's output plus
  B A x * alpha / rank, A and B the only trained tensors; which layers by default.
- `checkpoints.py`: checkpoints of the adapters alone, with their base's identity; the
  base rebuilt beneath them on resume.
- `peft.py`: adapters in PEFT's format (`adapter_config.json`, `adapter_model.safetensors`):
  written for `peft.PeftModel.from_pretrained`, read back to continue training.
"""

from dtrain.adapters.config import AdapterConfig
from dtrain.adapters.lora import LoRALinear, apply, built, default_targets

__all__ = ["AdapterConfig", "LoRALinear", "apply", "built", "default_targets"]
