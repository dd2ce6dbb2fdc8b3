"""The `[adapter]` section: which adapters a run trains, of what size, on which layers.

    [adapter]  kind = "lora", rank = 16, alpha = 32, targets = ["q_proj", "v_proj"]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dtrain.errors import ConfigError
from dtrain.schema import positive


@dataclass
class AdapterConfig:
    kind: Literal["none", "lora"] = "none"
    """none (every parameter trains) or lora (the base frozen, low-rank adapters trained
    beside the `targets`)."""
    rank: int = positive(8)
    """The adapters' rank r: A is r x in, B is out x r."""
    alpha: float = 16.0
    """The adapters' scale is alpha / rank (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on an adapter's input while training (PEFT's lora_dropout)."""
    targets: list[str] = field(default_factory=list)
    """The nn.Linear layers adapted: a name matches a layer whose last name part it is
    (q_proj), a dotted pattern its whole name, `*` for one part (blocks.*.attn.q_proj);
    empty: the architecture's attention and MLP projections (dtrain.adapters.lora)."""
    init: Literal["kaiming", "gaussian"] = "kaiming"
    """A's initial values: kaiming (uniform within 1/sqrt(in), PEFT's default) or gaussian
    (normal with std 1/rank, PEFT's init_lora_weights = "gaussian"); B starts at zero, so
    an adapted model starts as its base."""

    base_dtype: Literal["float32", "bfloat16"] = "float32"
    """The frozen base's dtype: bfloat16 holds it in half the memory and computes the
    model's products in bfloat16 (torch.autocast); the adapters, their gradients and
    optimizer state stay float32."""

    def check(self) -> None:
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"adapter.dropout = {self.dropout} must be in [0, 1)")
        if self.alpha <= 0:
            raise ConfigError(f"adapter.alpha = {self.alpha} must be above 0")


def check_adapter_layout(adapter: AdapterConfig, tp: int) -> None:
    """Adapters in the layouts they have been taught.

    Raises:
        ConfigError: adapter dropout with tensor parallelism (a row-parallel adapter would
            drop each rank's block of the input on its own).
    """
    if adapter.kind != "none" and adapter.dropout and tp > 1:
        raise ConfigError(f"adapter.dropout = {adapter.dropout} with parallel.tp = {tp} is not "
                          "supported yet (each rank would drop its own block of a split "
                          "layer's input): set adapter.dropout = 0 or parallel.tp = 1")
